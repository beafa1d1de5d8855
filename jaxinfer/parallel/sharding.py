"""Layouts: declarative device meshes (`shardings/*.toml`) and the shardings they imply.

A layout names mesh axes with sizes (-1 = the rest of the devices) and maps logical axes
(declared once on each parameter) to mesh axes; anything not named is replicated.
"""

from __future__ import annotations

import importlib.resources
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..config import ModelConfig
from ..errors import LayoutError
from ..shardings import BUILTIN

LOGICAL_AXES = (
    "batch", "seq", "cache_seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
    "layers", "experts", "linear_k", "linear_v",
)  # fmt: skip


@dataclass(frozen=True)
class Layout:
    name: str
    axes: tuple[tuple[str, int], ...]  # mesh axis -> size (-1 = the remaining devices)
    rules: tuple[tuple[str, str], ...]  # logical axis -> mesh axis
    doc: str = ""  # the file's leading comment: when to use it


def load_layout(spec: str | Path | Layout) -> Layout:
    """A built-in layout by name, or a TOML file by path."""
    if isinstance(spec, Layout):
        return spec
    if str(spec) in BUILTIN:
        text = importlib.resources.files("jaxinfer.shardings").joinpath(f"{spec}.toml").read_text()
        name = str(spec)
    else:
        path = Path(spec)
        if not path.is_file():
            raise LayoutError(
                f"layout {str(spec)!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file"
            )
        text, name = path.read_text(), path.stem
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(f"layout {name!r} is not valid TOML ({e})") from None
    unknown = set(data) - {"mesh", "rules"}
    if unknown:
        raise LayoutError(
            f"layout {name!r} has unknown tables {sorted(unknown)}; use [mesh], [rules]"
        )
    mesh = data.get("mesh", {})
    rules = data.get("rules", {})
    for axis, size in mesh.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise LayoutError(f"layout {name!r}: mesh axis {axis} = {size!r}; use a size or -1")
    if sum(1 for s in mesh.values() if s == -1) > 1:
        raise LayoutError(f"layout {name!r}: only one mesh axis may be -1")
    for logical, axis in rules.items():
        if logical not in LOGICAL_AXES:
            raise LayoutError(
                f"layout {name!r}: unknown logical axis {logical!r}; "
                f"known: {', '.join(LOGICAL_AXES)}"
            )
        if axis not in mesh:
            raise LayoutError(
                f"layout {name!r}: rule {logical} = {axis!r} names no mesh axis; "
                f"mesh axes: {', '.join(mesh) or 'none'}"
            )
    doc = " ".join(line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#"))
    return Layout(name, tuple(mesh.items()), tuple(rules.items()), doc)


def select_devices(devices=None, layout: Layout | None = None) -> list:
    """An explicit list of jax devices, an int (the first N), or None: every device, or as
    many as a layout without a -1 axis names."""
    available = jax.devices()
    if devices is None:
        if layout is not None and all(size != -1 for _, size in layout.axes):
            devices = math.prod(size for _, size in layout.axes)
        else:
            return available
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1 or devices > len(available):
            raise LayoutError(
                f"{devices} devices requested but {len(available)} exist; "
                f"pass --devices between 1 and {len(available)}"
            )
        return available[:devices]
    devices = list(devices)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise LayoutError(
            f"devices = {devices!r} is invalid; pass a device count or a list of jax devices"
        )
    return devices


def make_mesh(layout: Layout, devices: list) -> Mesh:
    """The layout's mesh over `devices` (a layout without axes uses one device)."""
    if not layout.axes:
        return Mesh(np.array(devices[:1]), ("replica",), axis_types=(AxisType.Auto,))
    names = [a for a, _ in layout.axes]
    known = math.prod(s for _, s in layout.axes if s != -1)
    sizes = [s if s != -1 else len(devices) // known for _, s in layout.axes]
    if math.prod(sizes) != len(devices) or min(sizes) < 1:
        shape = " x ".join(f"{a}={s}" for a, s in layout.axes)
        raise LayoutError(
            f"layout {layout.name!r} ({shape}) does not fit {len(devices)} devices; "
            f"pass --devices N with N a multiple of {known}"
        )
    grid = np.array(devices, dtype=object).reshape(sizes)
    return Mesh(grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))


def effective_rules(layout: Layout, mesh: Mesh, cfg: ModelConfig) -> dict[str, str]:
    """The layout's rules, checked against the model, with replication where it is cheap.

    KV heads and the vocabulary are replicated when they do not divide over their mesh axis
    (GQA with more devices than kv heads, odd vocab sizes); heads and MLP width must divide,
    or the layout is refused.
    """
    rules = dict(layout.rules)
    sizes = dict(mesh.shape)
    if cfg.linear_layers and "heads" in rules:  # linear layers split their heads like attention
        rules.setdefault("linear_v", rules["heads"])
        rules.setdefault("linear_k", rules["heads"])
    moe = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
    widths = [("d_ff", cfg.d_ff)] if len(moe) < cfg.n_layers else []
    if moe:
        widths += [("expert width", cfg.d_ff_expert)]
        widths += [("shared expert width", cfg.d_ff_shared)] if cfg.d_ff_shared else []
    dims = {
        "heads": [("n_heads", cfg.n_heads)],
        "kv_heads": [("n_kv_heads", cfg.n_kv_heads)],
        "mlp": widths,
        "vocab": [("vocab_size", cfg.vocab_size)],
        "embed": [("d_model", cfg.d_model)],
        "head_dim": [("head_dim", cfg.head_dim)],
        "linear_v": [("the linear-attention value heads", cfg.linear_v_heads)],
        "linear_k": [("the linear-attention key heads", cfg.linear_k_heads)],
    }
    for logical, fields in dims.items():
        axis = rules.get(logical)
        for field, value in fields:
            if axis is None or value % sizes[axis] == 0:
                continue
            if logical in ("kv_heads", "vocab", "linear_k"):  # replicated: cheap, still exact
                del rules[logical]
                continue
            raise LayoutError(
                f"layout {layout.name!r} needs {field} ({value}) divisible by {axis} "
                f"({sizes[axis]}); try --devices {_fitting(sizes, axis, value)} or layout 'layer'"
            )
    if "experts" in rules:
        axis = rules["experts"]
        if not moe:
            raise LayoutError(
                f"layout {layout.name!r} splits experts but the model has none; "
                "use layout 'single', 'tensor' or 'layer'"
            )
        if cfg.n_experts % sizes[axis]:
            raise LayoutError(
                f"layout {layout.name!r} splits {cfg.n_experts} experts over {axis} = "
                f"{sizes[axis]} devices, which does not divide; use --devices "
                f"{_fitting(sizes, axis, cfg.n_experts)} ({axis} a divisor of {cfg.n_experts})"
            )
    if "layers" in rules and sizes[rules["layers"]] > cfg.n_layers:
        axis = rules["layers"]
        raise LayoutError(
            f"layout {layout.name!r} has {sizes[axis]} pipeline stages but the model has "
            f"{cfg.n_layers} layers; use at most --devices {cfg.n_layers} or layout 'tensor'"
        )
    return rules


def _fitting(sizes: dict[str, int], axis: str, value: int) -> int:
    """A device count whose `axis` (the largest size up to its current one) divides `value`, the
    other mesh axes unchanged."""
    divisor = max(d for d in range(1, sizes[axis] + 1) if value % d == 0)
    return divisor * math.prod(s for a, s in sizes.items() if a != axis)


def spec(axes: tuple[str | None, ...], rules: dict[str, str]) -> P:
    """PartitionSpec of logical axes under `rules` (a mesh axis is used once at most)."""
    used, out = set(), []
    for logical in axes:
        axis = rules.get(logical) if logical else None
        out.append(axis if axis and axis not in used else None)
        used.add(axis)
    return P(*out)


def named(mesh: Mesh, partition: P | None = None) -> NamedSharding:
    return NamedSharding(mesh, P() if partition is None else partition)
