// The fused GEMV's device functions (engine.fast.gemv): a 16-byte weight load streamed past L1.
#include "faults.cuh"
__device__ __forceinline__ uint4 mlxp_ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
