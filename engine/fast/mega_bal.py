"""How the one-kernel step's warps share a phase's last units: dealt (the default), handed out
by counters (MLXP_MEGA_DYN=1) or read from a plan measured on this GPU (MLXP_MEGA_BAL=FILE).

Each projection phase has N units (q/k/v pairs, o_proj and down rows, gate/up pairs, head
rows); by default warp gw of NW takes units gw, gw + NW, ... If some SMs stream more slowly
than others every time (their blocks arrive last at every barrier), the phase waits for them.
MLXP_MEGA_BAL=FILE names what experiments/mega_blocks.py measured (each block's arrival time
per phase, summed over the layers, with the default dealing); from it `plan_table` gives each
block a share of the phase's last TAIL_ROUNDS rounds of units (plus the partial one) in
proportion to its measured speed: a block that took 20% longer gets fewer of them. Every unit
is still one warp's dot product over the same loads in the same order, so the logits are
those of the default kernel; only which warp computes which unit changes.

The kernel reads the plan as a linked list (the `after` input of a one-row call): a header of
four (N, offset) pairs, one per phase size, then for each unit n in [NS - NW, N) the next unit
of the warp that computes n (N: none), where NS = `static_units(N, NW)` units are dealt.
"""

from __future__ import annotations

import heapq
import json

# rounds of units a phase leaves to the plan (the rest are dealt, warp gw taking gw + k NW)
TAIL_ROUNDS = 3

DYN = r"""  // DYN (MLXP_MEGA_DYN=1, a compile-time choice: its registers would stay in the default kernel;
  // not with PRE 2, whose copies need a warp's next unit early): a phase's units [0, N) go
  // gw, gw + NW, ... over its static part [0, NS) (all but its last one or two rounds, the first
  // round at least), the rest from 8 counters (warp gw asks counter gw % 8, its j-th answer
  // being unit NS + gw % 8 + 8 j), so the SMs that stream faster take more of the last units.
  // A warp asks at the start of its last static unit and of each counted one, and reads the
  // answer after the unit's work (the atomic's round trip overlaps it)
  constexpr bool dyn = DYN == 1 && PRE != 2;
  // BAL (DYN 2, MLXP_MEGA_BAL): all but the last BAL_TAIL rounds dealt, the rest as a plan
  // measured on this GPU says (engine.fast.mega_bal): after its last dealt unit a warp follows
  // the plan's list, in `after`: a header of four (N, offset) pairs, then the next unit of each
  constexpr bool bal = DYN == 2 && PRE == 0;
  constexpr int BAL_TAIL = 3;
  auto dyn_ns = [&](int N) { const int r = N / NW;
    return dyn ? min(N, max(r - 1, 1) * NW) : bal ? min(N, max(r - BAL_TAIL, 1) * NW) : N; };
  auto dyn_ask = [&](int n, int N, int NS, unsigned int* c) {
    unsigned int got = 0u;
    if constexpr (dyn) {
      if (NS < N && n + NW >= NS && lane == 0) got = atomicAdd(c + (gw & 7), 1u);
    }
    return got;
  };
  auto dyn_next = [&](int n, int N, int NS, unsigned int got) {
    if constexpr (dyn) {
      if (NS < N && n + NW >= NS) return NS + (gw & 7) + 8 * (int)__shfl_sync(0xffffffffu, got, 0);
    }
    if constexpr (bal) {
      if (n + NW >= NS) {
        const int* tb = reinterpret_cast<const int*>(after);
        int off = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) if (__ldg(tb + 2 * j) == N) off = __ldg(tb + 2 * j + 1);
        return __ldg(tb + off + n - NS + NW);
      }
    }
    return n + NW;
  };
"""

# the calibration's phases and which of the step's sizes each one sets (o_proj and down share
# the hidden size: their measurements are added)
PHASE_SIZE = {"qkv_rope": "pairs", "o_proj": "hidden", "down": "hidden", "gate_up": "inter", "head": "vocab"}


def static_units(N: int, NW: int) -> int:
    """NS: the units dealt before the plan takes over (the kernel's dyn_ns with BAL)."""
    return min(N, max(N // NW - TAIL_ROUNDS, 1) * NW)


def dealt_units(N: int, NW: int, WPB: int, blocks: int) -> list:
    """Units each block takes when all N are dealt (warp gw: gw, gw + NW, ...)."""
    per_warp = [max(0, (N - gw + NW - 1) // NW) for gw in range(NW)]
    return [sum(per_warp[b * WPB:(b + 1) * WPB]) for b in range(blocks)]


def plan(N: int, blocks: int, WPB: int, cost: list) -> list:
    """For each warp (blocks * WPB of them, block-major), its units after the dealt ones: each
    unit in turn to the block that would finish it soonest (`cost[b]`: block b's time a unit),
    inside the block to its warp with the fewest units so far."""
    NW = blocks * WPB
    NS = static_units(N, NW)
    dealt = dealt_units(NS, NW, WPB, blocks)
    heap = [(cost[b] * (dealt[b] + 1), b) for b in range(blocks)]
    heapq.heapify(heap)
    taken = [0] * blocks
    out = [[] for _ in range(NW)]
    for u in range(NS, N):
        _, b = heapq.heappop(heap)
        w = min(range(WPB), key=lambda j: (len(out[b * WPB + j]), j))
        out[b * WPB + w].append(u)
        taken[b] += 1
        heapq.heappush(heap, (cost[b] * (dealt[b] + taken[b] + 1), b))
    return out


def links(N: int, NW: int, lists: list) -> list:
    """The plan as the kernel reads it: for n in [NS - NW, N), the next unit of n's warp (N: none)."""
    NS = static_units(N, NW)
    base = NS - NW
    nxt = [N] * (N - base)
    for gw in range(NW):
        chain = ([gw + (NS // NW - 1) * NW] if NS % NW == 0 else [gw] if gw < NS else []) + lists[gw]
        for a, b in zip(chain, chain[1:] + [N]):
            if a >= base:
                nxt[a - base] = b
    return nxt


def unit_costs(per_block_us: list, N: int, blocks: int, WPB: int) -> list:
    """A block's time a unit: its measured time over the units it took (dealt); blocks that
    took none get the median."""
    dealt = dealt_units(N, blocks * WPB, WPB, blocks)
    c = [t / d for t, d in zip(per_block_us, dealt) if d > 0]
    med = sorted(c)[len(c) // 2] if c else 1.0
    return [per_block_us[b] / dealt[b] if dealt[b] > 0 and per_block_us[b] > 0 else med for b in range(blocks)]


def plan_table(calibration: dict, sizes: dict, blocks: int, WPB: int) -> list:
    """The kernel's plan (int32 words) from mega_blocks' result (`calibration["phases"][name]
    ["per_block_us"]`) for the step's sizes {"pairs", "hidden", "inter", "vocab"}. Phases of
    one size share a plan, made from their measurements together (any plan for N units is a
    valid one for every phase of N units)."""
    phases = calibration.get("phases", {})
    NW = blocks * WPB
    keys = ("pairs", "hidden", "inter", "vocab")
    header, body, at = [], [], {}
    for N in sorted({sizes[k] for k in keys}):
        names = [p for p, k in PHASE_SIZE.items() if sizes[k] == N]
        meas = [phases[p]["per_block_us"] for p in names if p in phases]
        if not meas or any(len(m) != blocks for m in meas):
            raise ValueError(f"MLXP_MEGA_BAL: the calibration has no per-block times of {names} for "
                             f"{blocks} blocks (run experiments/mega_blocks.py on this GPU and grid)")
        per_block = [sum(v) for v in zip(*meas)]
        at[N] = 8 + len(body)
        body += links(N, NW, plan(N, blocks, WPB, unit_costs(per_block, N, blocks, WPB)))
    for k in keys:
        header += [sizes[k], at[sizes[k]]]
    return header + body


def load_table(path: str, sizes: dict, blocks: int, WPB: int) -> list:
    try:
        with open(path) as f:
            cal = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"MLXP_MEGA_BAL: cannot read {path}: {e}") from None
    return plan_table(cal, sizes, blocks, WPB)


def walk(table: list, N: int, NW: int, gw: int) -> list:
    """The units warp gw computes in a phase of N (a mirror of the kernel's loop and dyn_next)."""
    off = next(table[2 * j + 1] for j in range(4) if table[2 * j] == N)
    NS = static_units(N, NW)
    out, n = [], gw
    while n < N:
        out.append(n)
        n = table[off + n - NS + NW] if n + NW >= NS else n + NW
    return out
