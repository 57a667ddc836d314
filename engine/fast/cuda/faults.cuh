// The L3 gate's negative control (engine.fast.kernels.inject_fault): a build with
// L3_FAULT_SHIFT 1 rotates q and k one position off, with L3_FAULT_DROP 1 attention leaves
// out the newest key. Only a build the tests ask for defines them (engine.fast.kernels
// .cuda_kernel: another kernel name); the production kernels get the 0s below.
#ifndef L3_FAULT_SHIFT
#define L3_FAULT_SHIFT 0
#endif
#ifndef L3_FAULT_DROP
#define L3_FAULT_DROP 0
#endif
