"""Shared pieces of the Triton kernels: arrival counters for one-launch reductions, small helpers.

Several decode kernels split one reduction over many programs (split-K GEMV, the experts' sum
over k, the GDN head norm). Rather than a second launch to combine the partial results, each
program writes its partial to a workspace, then bumps an arrival counter; the program that
arrives last combines the partials and resets the counter to zero for the next call. One launch,
no memset, safe to capture in a CUDA graph. That suits small partials; where the last program
would read a lot (flash-decoding's 16 rows x 256 dims per split, decode_attention.py), a second
launch that merges in parallel is faster.

The counters live in a zero-initialised int32 buffer per (device, user). Two launches that run
at the same time on different streams must not share counters: pass each its own buffer
(`new_counters`), or launch one of them inside `counter_space` (what `beside` does for the
second stream).

Also here: programmatic dependent launch (`pdl_options`, `wait_for_inputs`) and the second
stream (`beside`).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_COUNTERS: dict[tuple[str, str, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # counter buffers replaced by larger ones: a CUDA graph captured on one still uses it
_SPACES = [""]  # the innermost `counter_space`


# Small decode kernels are bound by latency, not bandwidth: two independent chains of them finish
# sooner side by side. `beside` launches one chain on a second stream (one per device), forked from
# the current stream and joined back before its result is used; under CUDA-graph capture the graph
# gets two branches. Used for the MoE's shared expert (beside the router and the routed gate_up)
# and the GDN's b/a projection (beside in_proj_qkv+z). ROOFLINE_SECOND_STREAM=0 keeps one stream.
SECOND_STREAM = os.environ.get("ROOFLINE_SECOND_STREAM", "1") != "0"
_STREAMS: dict[int, torch.cuda.Stream] = {}


def second_stream(device) -> torch.cuda.Stream | None:
    """The second stream of `device`, or None (not CUDA, or opted out)."""
    device = torch.device(device)
    if not SECOND_STREAM or device.type != "cuda" or INTERPRET:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(index)
    return _STREAMS[index]


def beside(device, fn, *args):
    """fn(*args) launched on the second stream, forked from the current one (or here, without one); returns
    (result, join): call join() before the current stream uses the result."""
    side = second_stream(device)
    if side is None:
        return fn(*args), lambda: None
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side), counter_space("second stream"):
        out = fn(*args)
    return out, lambda: main.wait_stream(side)


@contextlib.contextmanager
def counter_space(name: str):
    """Inside the block, `counters_for` hands out buffers of their own: for kernels launched on a second stream
    (the MoE's shared expert beside the routed experts) while the same kernels run on the main stream."""
    _SPACES.append(name)
    try:
        yield
    finally:
        _SPACES.pop()


def new_counters(size: int, device) -> torch.Tensor:
    """A zeroed int32 counter buffer; the kernels leave it zeroed after each complete launch."""
    return torch.zeros(size, dtype=torch.int32, device=device)


def counters_for(user: str, size: int, device: torch.device) -> torch.Tensor:
    """The default counter buffer of one kernel (`user`) on `device`, grown as needed. A grown-out buffer is kept
    alive: graphs captured before (a smaller batch's bucket) hold its address, and its memory must not be reused."""
    key = (user, str(device), _SPACES[-1])
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < size:
        if torch.cuda.is_available() and torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{user}: counter buffer too small during CUDA-graph capture; warm up outside capture first")
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = new_counters(max(size, 4096), device)
        _COUNTERS[key] = buf
    return buf


# Programmatic dependent launch (sm_90+): each decode kernel is launched while the previous one
# still runs; it issues its first weight loads (memory no kernel of the step writes), then
# `wait_for_inputs` blocks until the previous kernel has finished and its writes are visible, and
# lets the next kernel launch in turn. That hides the launch gap and the first loads' latency
# behind the previous kernel's tail. Safe by construction: before the wait a kernel writes nothing
# and reads only what no kernel that may still run writes (weights; a GDN layer's own recurrent
# state; the routing, which the experts' down kernel reads two kernels after the router); the next
# kernel launches only after every program has passed its wait, so a kernel started early never
# overtakes one two steps back. ROOFLINE_PDL=0 opts out.
PDL_ENABLED = os.environ.get("ROOFLINE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device) -> bool:
    """Whether decode kernels on `device` launch with programmatic dependent launch (CUDA sm_90+, not opted out)."""
    device = torch.device(device)
    return PDL_ENABLED and not INTERPRET and device.type == "cuda" and _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_options(device) -> dict:
    """Launch arguments of a decode kernel with a `PDL` constexpr: on where `pdl_supported`."""
    return {"PDL": True, "launch_pdl": True} if pdl_supported(device) else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL: wait for the previous kernel (its writes visible), then let the next one launch. A no-op without."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


MAX_ROWS = 4  # decode kernels read each weight tile once for up to this many rows


def decode_rows(x: torch.Tensor, k: int, kernel: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x [..., K] -> (contiguous [M, K], leading shape); M must be 1..MAX_ROWS."""
    x2 = x.reshape(-1, k).contiguous()
    if not 1 <= x2.shape[0] <= MAX_ROWS:
        raise ValueError(f"{kernel} is a decode kernel for 1..{MAX_ROWS} rows, got {x2.shape[0]}")
    return x2, x.shape[:-1]


def rows_in_place(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A [N, ...] kernel input whose rows t[i] are each contiguous but may lie any distance apart (a merged
    projection's column view, as q/k/v, qkv+z, b+a and the router + shared gate write them) -> (t, row stride), with
    no copy; copied only where a row's own elements are not contiguous. At N > 1 (an MTP verify step) a copy per
    input was a PyTorch launch that also broke the decode kernels' PDL chain."""
    if len(t) and not t[0].is_contiguous():
        t = t.contiguous()
    return t, t.stride(0)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def triton_dtype(dtype: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


@triton.jit
def pick(v, idx, i: tl.constexpr):
    """Where idx == i, v summed over axis 0: element i of a small 1-D tensor as a scalar, or with idx [R, 1] row i
    of an [R, N] tensor."""
    return tl.sum(tl.where(idx == i, v, 0), axis=0)


@triton.jit
def arrive(counter_ptr, expected):
    """Count this program's arrival; True in the program that arrives last (it then resets the counter).

    The barrier makes every thread's prior stores part of what the acq_rel atomic publishes; the
    last program reads the partials with `.cg` loads (L2, never a stale L1 line).
    """
    tl.debug_barrier()
    count = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = count == expected - 1
    return last


@triton.jit
def reset(counter_ptr):
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def sum_splits(ptr, split_stride, offs, mask, SPLIT, SPLITP: tl.constexpr, CHUNK: tl.constexpr):
    """Sum over s < SPLIT of ptr[s * split_stride + offs] (fp32, `offs`/`mask` 2-D), read through L2.

    The loads of a chunk of CHUNK splits go out together and the chunks are unrolled (SPLITP, a
    power of two >= SPLIT, is a compile-time bound), so the last program waits about one memory
    round trip, not one per split.
    """
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for c in tl.static_range(0, SPLITP, CHUNK):
        s = c + tl.arange(0, CHUNK)
        part = tl.load(ptr + s[:, None, None] * split_stride + offs[None, :, :],
                       mask=(s < SPLIT)[:, None, None] & mask[None, :, :], other=0, cache_modifier=".cg")
        acc += tl.sum(part, axis=0)
    return acc


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` (4 under the interpreter or off CUDA: small test grids)."""
    device = torch.device(device)
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
