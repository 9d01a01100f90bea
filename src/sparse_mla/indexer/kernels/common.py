"""What the logits and top-k launchers share: how a config argument becomes a frozen config, and
how work is split over the GPU's SMs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeVar

import torch

from ...core.env import cdiv, cuda_num_sms

C = TypeVar("C")


def resolve_config(config: object, default: C) -> C:
    """``config`` as an instance of ``default``'s frozen dataclass: None gives ``default``, an
    instance is taken as it is, a mapping replaces those fields of ``default`` (the class checks
    the values; ``ValueError`` naming an unknown key, ``TypeError`` for anything else)."""
    cls = type(default)
    if config is None:
        return default
    if isinstance(config, cls):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config: expected a dict of {cls.__name__} fields, a {cls.__name__} or None, got {type(config).__name__}"
        )
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - names)
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown}; known: {sorted(names)}")
    return dataclasses.replace(default, **config)


def split_work(n_tiles: int, programs: int, target: int) -> tuple[int, int]:
    """``(tiles_per_prog, splits)``: split ``n_tiles`` into about ``target / programs`` even parts."""
    splits = max(1, min(n_tiles, -(-target // max(programs, 1))))
    per = cdiv(n_tiles, splits)
    return per, cdiv(n_tiles, per)


def sm_count(device: torch.device, num_sms: int | None = None) -> int:
    """``num_sms`` when given, else the device's SM count (1 off CUDA: the interpreter)."""
    if num_sms is not None:
        return max(1, int(num_sms))
    return cuda_num_sms(device) if device.type == "cuda" else 1
