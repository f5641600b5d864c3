"""TE's `transformer_engine.pytorch._extra_state`: which pickled `_extra_state` payloads need unpickling.

TE (2.20+) unpickles a module's `_extra_state` only when the payload can carry FP8 delayed-scaling state,
and then only with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1; payloads of stateless recipes are ignored.
`should_load_extra_state_pickle` is that decision, made from the pickle's opcodes without executing it.

The stand-in's own modules do not use it: their set_extra_state reads every payload with a restricted
unpickler that executes no pickled code (te_parallel.te_layout), so they need no opt-in. This module is
for code that unpickles TE extra state itself, as TE's modules do.
"""
from __future__ import annotations

import enum
import os
import pickletools
from typing import Iterator, Optional, Tuple

from transformer_engine.common import recipe as _recipe

__all__ = ["UNSAFE_PICKLE_EXTRA_STATE_ENV", "CheckpointExtraStatePolicy", "recipe_extra_state_policy",
           "is_stateless_recipe", "unsafe_pickle_extra_state_enabled", "extra_state_pickle_advisory",
           "should_load_extra_state_pickle"]

UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"  # TE's opt-in, read at each decision


class CheckpointExtraStatePolicy(enum.Enum):
    """What a recipe's pickled extra state holds: nothing (STATELESS), delayed-scaling FP8 state (the one
    payload that must be unpickled), or depends on the payload (DYNAMIC: a custom recipe)."""

    STATELESS = "stateless"
    STATEFUL_FP8_DELAYED_SCALING = "stateful_fp8_delayed_scaling"
    DYNAMIC = "dynamic"


_RECIPE_MODULE = "transformer_engine.common.recipe"  # the module a pickled recipe names (TE's and the stand-in's)
_POLICY_OF_CLASS = {_recipe.DelayedScaling: CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING,
                    _recipe.Float8CurrentScaling: CheckpointExtraStatePolicy.STATELESS,
                    _recipe.MXFP8BlockScaling: CheckpointExtraStatePolicy.STATELESS,
                    _recipe.Float8BlockScaling: CheckpointExtraStatePolicy.STATELESS,
                    _recipe.NVFP4BlockScaling: CheckpointExtraStatePolicy.STATELESS,
                    _recipe.CustomRecipe: CheckpointExtraStatePolicy.DYNAMIC}
# keyed as a pickle names a class: (module, qualified name)
_RECIPE_POLICIES = {(_RECIPE_MODULE, cls.__name__): policy for cls, policy in _POLICY_OF_CLASS.items()}

_RECIPE_KEY = "recipe"
_DELAYED_STATE_KEYS = frozenset({"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"})
_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "BINUNICODE8",
                         "SHORT_BINUNICODE"})


def recipe_extra_state_policy(recipe) -> Optional[CheckpointExtraStatePolicy]:
    """The policy of a recipe object of TE's recipe module (None for any other class)."""
    cls = type(recipe)
    return _RECIPE_POLICIES.get((cls.__module__, cls.__name__))


def is_stateless_recipe(recipe) -> bool:
    return recipe_extra_state_policy(recipe) is CheckpointExtraStatePolicy.STATELESS


def unsafe_pickle_extra_state_enabled() -> bool:
    return os.getenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "0") == "1"


def extra_state_pickle_advisory(context: str) -> str:
    return (f"refusing to unpickle Transformer Engine extra state for {context}: it can hold FP8 delayed-scaling "
            f"state, and unpickling can execute arbitrary code; if the checkpoint is trusted, set "
            f"{UNSAFE_PICKLE_EXTRA_STATE_ENV}=1")


def should_load_extra_state_pickle(data: bytes, context: str) -> bool:
    """False: the payload is empty or a stateless recipe's, ignore it. True: it must be unpickled and
    the unsafe opt-in is set. Otherwise RuntimeError with the advisory (TE's rule)."""
    if not _needs_unpickling(data):
        return False
    if unsafe_pickle_extra_state_enabled():
        return True
    raise RuntimeError(extra_state_pickle_advisory(context))


def _needs_unpickling(data: bytes) -> bool:
    """Whether the payload may carry state that only unpickling recovers. A malformed pickle does."""
    if not data:
        return False
    strings, globals_ = [], []
    try:
        for kind, value in _strings_and_globals(data):
            (strings if kind == "string" else globals_).append(value)
    except Exception:  # anything pickletools cannot walk: let the caller's (opted-in) unpickler decide
        return True
    delayed_keys = any(s in _DELAYED_STATE_KEYS for s in strings)
    if not globals_:
        return delayed_keys  # resolves no global: builds no callable (an old stateless checkpoint's {})
    policies = {_RECIPE_POLICIES[g] for g in globals_ if g in _RECIPE_POLICIES}
    if _RECIPE_KEY not in strings or delayed_keys or not policies:
        return True  # TE 1.x delayed-scaling state (no recipe), delayed-scaling keys, or an unknown shape
    return CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING in policies


def _strings_and_globals(data: bytes) -> Iterator[Tuple[str, object]]:
    """("string", text) for each string opcode, ("global", (module, name) or None when unreadable) for each
    global the pickle resolves."""
    recent = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in _STRING_OPS:
            try:
                text = arg.decode("utf-8") if isinstance(arg, bytes) else arg
            except UnicodeDecodeError:
                continue
            recent.append(text)
            yield "string", text
        elif opcode.name == "GLOBAL":  # protocol <= 3: "module name" in the opcode
            parts = arg.split() if isinstance(arg, str) else []
            yield "global", tuple(parts) if len(parts) == 2 else None
        elif opcode.name == "STACK_GLOBAL":  # protocol 4+: the last two strings pushed
            yield "global", (recent[-2], recent[-1]) if len(recent) >= 2 else None
