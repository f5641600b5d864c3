"""RNG state tracker for dropout inside tensor-parallel regions (Megatron / TE convention).

Dropout on an activation that every TP rank holds in full (replicated) must draw the same mask on every
rank, or the replicas diverge; dropout on an activation that is sharded across TP ranks (attention
probabilities of a rank's heads, the [s, b, h/tp] output of a column-parallel GEMM) must draw a
different mask per rank, or the shards share one mask pattern and the model sees correlated noise.
So there are two streams: the default RNG, seeded with `seed` on every TP rank, and a named
"model-parallel-rng" state seeded with `seed + 2718 + tp_rank`, which the modules swap in with
`tracker.fork()` around dropout on sharded activations.

No tracker lives in a module-level global (DESIGN §1): the training script makes one and hands the
modules a callable, TE's `get_rng_state_tracker` argument::

    import torch
    import te_parallel as te
    from te_parallel.parallel.random import CudaRNGStatesTracker, model_parallel_seed

    seed = 1234
    torch.manual_seed(seed)                      # default RNG: the same on every TP rank
    tracker = CudaRNGStatesTracker()             # device="cpu" for CPU runs (gloo, CI)
    model_parallel_seed(tracker, seed, tp_rank=torch.distributed.get_rank(tp_group))
    layer = te.TransformerLayer(..., tp_group=tp_group, get_rng_state_tracker=lambda: tracker)
    with tracker.fork():                         # a rank-specific mask, e.g. your own dropout
        y_local = torch.nn.functional.dropout(x_local, p=0.1)

For activation checkpointing the recompute must replay the same masks: save `tracker.get_states()`
before the forward and `tracker.set_states(...)` before the recompute (te.checkpoint does this).
"""
import contextlib
from typing import Dict, Iterator, Optional, Union

import torch

__all__ = ["CudaRNGStatesTracker", "RNGStatesTracker", "model_parallel_seed", "MODEL_PARALLEL_RNG"]

MODEL_PARALLEL_RNG = "model-parallel-rng"  # Megatron's and TE's default name for the TP stream


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)  # "cuda" without an index: the current device
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _fresh_state(seed: int, device: torch.device) -> torch.Tensor:
    # A private Generator yields the state `manual_seed(seed)` would leave, in the same byte format as
    # get_rng_state, without touching the default generator. (torch.manual_seed would also reseed every
    # CUDA device, and save/seed/restore on the default generator is a window where it is disturbed.)
    return torch.Generator(device=device).manual_seed(seed).get_state()


class CudaRNGStatesTracker:
    """Named RNG states that `fork(name)` swaps in for the default generator of `device`.

    device: "cuda" (the current CUDA device), "cuda:N", or "cpu" (torch's CPU generator, for CPU / gloo
    runs and CI). Default: "cuda" when CUDA is available, else "cpu". `RNGStatesTracker` is the same
    class under a device-neutral name.
    """

    def __init__(self, device: Union[str, torch.device, None] = None) -> None:
        self.device = torch.device(device if device is not None else _default_device())
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"CudaRNGStatesTracker device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"CudaRNGStatesTracker(device={device!r}) needs CUDA, which is not available; "
                               "pass device='cpu'")
        self.reset()

    def reset(self) -> None:
        """Forget every named state and seed."""
        self._states: Dict[str, torch.Tensor] = {}
        self._seed_owner: Dict[int, str] = {}  # seed -> name, so a duplicate seed can name its owner

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the named states (name -> byte tensor), e.g. to replay dropout in a recompute."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the named states with `states` (as returned by get_states). Seeds are kept: they
        still guard `add` against reusing a seed."""
        for name, state in states.items():
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                got = state.dtype if isinstance(state, torch.Tensor) else type(state).__name__
                raise TypeError(f"set_states: state {name!r} must be a uint8 tensor from get_states(), got {got}")
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name` seeded with `seed`; the caller's current RNG state is not touched."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} is already tracked; pick another name or reset() the tracker")
        if seed in self._seed_owner:
            raise ValueError(f"seed {seed} for RNG state {name!r} is already used by "
                             f"{self._seed_owner[seed]!r}; give each state its own seed")
        self._states[name] = _fresh_state(seed, self.device)
        self._seed_owner[seed] = name

    @contextlib.contextmanager
    def fork(self, name: Optional[str] = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state `name` inside the block; on exit store its advanced state back in the
        tracker (the next fork continues the stream) and restore the caller's state exactly."""
        name = MODEL_PARALLEL_RNG if name is None else name  # TE modules pass rng_tracker_name=None
        if name not in self._states:
            raise KeyError(f"no RNG state named {name!r} (tracked: {sorted(self._states)}); "
                           "add it with tracker.add(name, seed) or model_parallel_seed(tracker, ...)")
        outer = _get_state(self.device)
        _set_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(outer, self.device)


RNGStatesTracker = CudaRNGStatesTracker  # device-neutral name: the class works on CPU as well


def model_parallel_seed(tracker: CudaRNGStatesTracker, seed: int, tp_rank: int,
                        name: str = MODEL_PARALLEL_RNG, offset: int = 2718) -> int:
    """Add the TP stream `name` with seed `seed + offset + tp_rank` to `tracker`; return that seed.

    Megatron's `model_parallel_cuda_manual_seed` convention: a different seed per TP rank for dropout on
    sharded activations, offset from `seed` so the TP stream is not the default stream. The
    default RNG is the script's to seed with `seed` itself (torch.manual_seed(seed), the same on every
    TP rank, for dropout on replicated activations); this function does not touch it. Only tp_rank
    varies the seed here: to vary it across pipeline stages too, vary `seed` (Megatron passes
    seed + 100 * pipeline rank).
    """
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
        raise ValueError(f"model_parallel_seed: tp_rank must be an int >= 0, got {tp_rank!r}")
    tp_seed = seed + offset + tp_rank
    tracker.add(name, tp_seed)
    return tp_seed
