"""Design-space sweeps: one :func:`~dfmodel.optimizer.optimize` call per point of a grid.

A sweep spec (YAML file or dict) names workloads, systems and the values to vary::

    # sweep.yaml
    workloads: [gpt3_13b]               # preset names, paths (relative to this file) or mappings
    systems: [dgx_a100, dgx_h100]
    num_chips: [64, 128, 256]           # optional axis: resizes each system's outermost dimension
    overrides:                          # one grid axis per key, a list of values each
      system.chip.memory.bandwidth_Bps: [1e12, 2 TB/s, 3e12]
      system.network.1.link_bandwidth_Bps: [25 GB/s, 50 GB/s]   # a number = list index
      workload.training.global_batch: [512, 1024]
      tp: [4, 8]                        # a mapping knob may be an axis too
    zip:                                # each group is ONE axis: its lists vary together
      - {workload.training.global_batch: [256, 512], system.network.-1.size: [8, 16]}
    fixed: {recompute: full, sequence_parallel: true}   # knobs held for every point
    solver: auto                        # auto | highs | gurobi
    time_limit_s: 60                    # per MILP solve (null = no limit)

The points are the cartesian product of, in this order (the last varies fastest): workloads,
systems, ``num_chips``, each ``overrides`` key, each ``zip`` group. Override keys are dotted
field paths into a system (``system.``) or workload (``workload.``) spec -- a number steps into
a list (negative counts from the end) -- or a mapping knob of ``optimize`` (``tp``, ``pp``,
``dp``, ``micro_batch``, ``recompute``, ``sequence_parallel``, ``interleave``,
``distributed_optimizer``, ``num_chips``). A path the schema does not have, or an index out
of range, is an :class:`~dfmodel.errors.InputError` before anything runs. A value is checked
when its point runs, by validating the modified spec: a bad value fails that point (its error is
recorded), not the sweep. In the YAML, ``1e11`` is a number (YAML 1.2), not a string.

Every finished point is appended at once to a JSON-lines file, one complete line each::

    {"id": "3f2a9c...", "index": 4,
     "inputs": {"workload": "gpt3_13b", "system": "dgx_a100",
                "overrides": {"num_chips": 128, "system.chip.memory.bandwidth_Bps": 2e12},
                "fixed": {"recompute": "full"}, "solver": "auto", "time_limit_s": null},
     "result": {...Result.to_dict()...} or null,
     "error": null or {"type": "InfeasibleError", "message": "no mapping fits ..."},
     "wall_s": 1.9}

``id`` is a hash of the point's inputs (the workload's and system's contents, not their file
names, so editing a file makes new points); ``resume=True`` runs only the points whose id is
not in the file yet. A kill at any moment loses only the points still running.

>>> from dfmodel import sweep, load_results                                 # doctest: +SKIP
>>> sweep("sweep.yaml", out="results.jsonl", workers=8)                    # doctest: +SKIP
>>> df = load_results("results.jsonl")                                     # doctest: +SKIP
>>> df.groupby("system")["throughput.samples_per_s"].max()                 # doctest: +SKIP
"""

from __future__ import annotations

import copy
import enum
import hashlib
import itertools
import json
import os
import re
import signal
import sys
import time
import types
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, StrictBool

from dfmodel.errors import DFModelError, InputError

KNOBS = ("tp", "pp", "dp", "micro_batch", "recompute", "sequence_parallel", "interleave",
         "distributed_optimizer", "num_chips")
EXECUTORS = ("process", "ray")
_ID_VERSION = 1  # bump when the meaning of a point's inputs changes, so old ids stop matching


# -- the spec ------------------------------------------------------------------------------------


class FixedKnobs(BaseModel):
    """Mapping knobs of :func:`~dfmodel.optimizer.optimize` held for every point (None = searched)."""

    model_config = ConfigDict(extra="forbid")

    tp: PositiveInt | None = None
    pp: PositiveInt | None = None
    dp: PositiveInt | None = None
    micro_batch: PositiveInt | None = None
    recompute: Literal["none", "selective", "full"] | None = None
    sequence_parallel: StrictBool | None = None
    interleave: PositiveInt | None = None
    distributed_optimizer: StrictBool | None = None
    num_chips: PositiveInt | None = None


Values = typing.Annotated[list[Any], Field(min_length=1)]


class SweepSpec(BaseModel):
    """A sweep, as written in its YAML (see the module doc)."""

    model_config = ConfigDict(extra="forbid")

    description: str = ""
    workloads: list[Any] = Field(min_length=1)
    systems: list[Any] = Field(min_length=1)
    num_chips: list[PositiveInt] | None = Field(default=None, min_length=1)
    overrides: dict[str, Values] = Field(default_factory=dict)
    zip: list[typing.Annotated[dict[str, Values], Field(min_length=1)]] = Field(default_factory=list)
    fixed: FixedKnobs = Field(default_factory=FixedKnobs)
    solver: Literal["auto", "highs", "gurobi"] = "auto"
    time_limit_s: PositiveFloat | None = None


@dataclass(frozen=True)
class Point:
    """One optimize call: what the worker needs (plain data, so it pickles to any process)."""

    index: int
    id: str
    inputs: dict[str, Any]  # workload/system labels, overrides, fixed, solver, time_limit_s
    workload_data: dict[str, Any] = field(repr=False)
    system_data: dict[str, Any] = field(repr=False)


@dataclass
class _Base:
    """One entry of ``workloads:`` or ``systems:``, loaded and validated."""

    label: str
    data: dict[str, Any]
    model: type[BaseModel]


# -- YAML with YAML 1.2 floats ----------------------------------------------------------------------


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e11`` as a float: YAML 1.1 wants ``1.0e+11``, nobody writes that."""


# copy the resolver table before adding to it, so yaml.SafeLoader itself is left alone
_SpecLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _read_spec_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "document"
        raise InputError(f"malformed YAML: {getattr(exc, 'problem', None) or exc}", source=str(path), field=where) from None
    if not isinstance(data, dict):
        raise InputError("expected a YAML mapping at top level", source=str(path), field="<root>")
    return data


def load_spec(spec: str | Path | dict[str, Any] | SweepSpec) -> tuple[SweepSpec, str, Path | None]:
    """``(spec, source for error messages, folder that relative paths are read from)``."""
    from dfmodel.yamlio import validate

    if isinstance(spec, SweepSpec):
        return spec, "<sweep>", None
    if isinstance(spec, dict):
        return validate(SweepSpec, spec, "<sweep>"), "<sweep>", None
    if not isinstance(spec, (str, Path)):
        raise InputError(f"expected a sweep YAML path or a dict, got {type(spec).__name__}", field="spec")
    path = Path(spec)
    return validate(SweepSpec, _read_spec_yaml(path), str(path)), str(path), path.parent


# -- dotted paths -----------------------------------------------------------------------------------


def _branches(tp: Any) -> list[Any]:
    """The alternatives of a (possibly Annotated / Optional) type, Annotated stripped, None dropped."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        out = []
        for arg in typing.get_args(tp):
            out.extend(_branches(arg))
        return out
    return [] if tp is type(None) else [tp]


def _shape(tp: Any) -> str:
    """model | list | tuple | dict | scalar."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "model"
    origin = typing.get_origin(tp) or tp
    if origin in (list, set, frozenset):
        return "list"
    if origin is tuple:
        return "tuple"
    if origin is dict:
        return "dict"
    return "scalar"


def _pick(tp: Any, node: Any) -> Any:
    """The branch of ``tp`` the data ``node`` takes (a container branch when the node is absent)."""
    options = _branches(tp)
    want = {dict: ("model", "dict"), list: ("list", "tuple")}.get(type(node))
    if node is None:
        want = ("model", "dict", "list", "tuple")
    elif want is None:
        want = ("scalar",)
    for shape in want:
        for option in options:
            if _shape(option) == shape:
                return option
    return options[0] if options else Any


def check_path(model: type[BaseModel], data: dict[str, Any], parts: list[str]) -> str | None:
    """Why ``parts`` is not a settable field path of ``model`` given the file ``data``; None if it is.

    Walks the pydantic schema (not just the file, so a field left at its default can be set)
    and the data side by side (so list indexes are checked against the lists really there).

    >>> from dfmodel.system.schema import System
    >>> data = {"network": [{"name": "a"}, {"name": "b"}], "chip": {"memory": {}}}
    >>> check_path(System, data, ["network", "1", "link_bandwidth_Bps"]) is None
    True
    >>> check_path(System, data, ["network", "2", "size"])
    'network.2: index out of range (the list has 2 items)'
    >>> check_path(System, data, ["chip", "memory", "bandwith_Bps"])[:73]
    "chip.memory: unknown field 'bandwith_Bps' (did you mean 'bandwidth_Bps'? "
    """
    tp: Any = model
    node: Any = data
    walked: list[str] = []
    for part in parts:
        where = ".".join(walked) or "<root>"
        tp = _pick(tp, node)
        shape = _shape(tp)
        if shape == "model":
            if part not in tp.model_fields:
                from dfmodel.presets import did_you_mean

                best = did_you_mean(part, tp.model_fields)
                hint = f"did you mean {best!r}? " if best else ""
                return f"{where}: unknown field {part!r} ({hint}fields: {', '.join(tp.model_fields)})"
            tp = tp.model_fields[part].annotation
            node = node.get(part) if isinstance(node, dict) else None
        elif shape in ("list", "tuple"):
            try:
                i = int(part)
            except ValueError:
                return f"{where}: is a list, expected an index, got {part!r}"
            if not isinstance(node, list):
                return f"{where}: cannot index a list that is not in the file"
            if not -len(node) <= i < len(node):
                return f"{where}.{part}: index out of range (the list has {len(node)} items)"
            args = typing.get_args(tp)
            tp = args[0] if args else Any
            node = node[i]
        elif shape == "dict":
            key_tp, val_tp = (typing.get_args(tp) + (Any, Any))[:2]
            keys = [k.value for k in key_tp] if isinstance(key_tp, type) and issubclass(key_tp, enum.Enum) else None
            if keys is not None and part not in keys:
                return f"{where}: unknown key {part!r} (keys: {', '.join(keys)})"
            tp = val_tp
            node = node.get(part) if isinstance(node, dict) else None
        elif node is not None and not isinstance(node, (dict, list)):
            return f"{where}: is a single value ({node!r}) in the file; override {where} itself"
        else:
            return f"{where}: is a single value, has no field {part!r}"
        walked.append(part)
    return None


def _set_path(data: dict[str, Any], parts: list[str], value: Any) -> None:
    """Set ``value`` at ``parts`` in a plain dict (checked by :func:`check_path` beforehand)."""
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if last:
                node[int(part)] = copy.deepcopy(value)
            else:
                node = node[int(part)]
        else:
            if last:
                node[part] = copy.deepcopy(value)
            else:
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}  # a field left at its default (e.g. storage): start it
                node = node[part]


# -- expanding a spec into points ---------------------------------------------------------------


def _load_bases(entries: list[Any], kind: str, source: str, base_dir: Path | None) -> list[_Base]:
    from dfmodel.graph.workload import load_workload
    from dfmodel.presets import list_presets, resolve
    from dfmodel.system import load_system
    from dfmodel.system.schema import System
    from dfmodel.yamlio import read_yaml

    load = load_system if kind == "systems" else load_workload
    out = []
    for i, entry in enumerate(entries):
        where = f"{kind}.{i}"
        if isinstance(entry, BaseModel):
            # a loaded object: its JSON dump round-trips through the schema (units are SI floats)
            data = entry.model_dump(mode="json")
            label = getattr(entry, "name", where)
        elif isinstance(entry, dict):
            data, label = copy.deepcopy(entry), str(entry.get("name") or where)
        elif isinstance(entry, (str, Path)):
            p = Path(entry)
            # relative paths are read next to the sweep file first, then from the cwd / presets
            if base_dir is not None and not p.is_absolute() and (base_dir / p).is_file():
                p = base_dir / p
            else:
                p = resolve(p, kind)
            if not p.is_file():
                from dfmodel.presets import suggestion

                names = ", ".join(x.stem for x in list_presets(kind)) or "none"
                raise InputError(f"no such file or preset {str(entry)!r}{suggestion(entry, kind)} (presets: {names})",
                                 source=source, field=where)
            data, label = read_yaml(p), str(entry)
            loaded = load(p)  # validated with the file's name in any error
        else:
            raise InputError(f"expected a preset name, path or mapping, got {type(entry).__name__}", source=source, field=where)
        if not isinstance(entry, (str, Path)):
            loaded = load(data)
        model = System if kind == "systems" else type(loaded)
        out.append(_Base(label, data, model))
    return out


def _axes(spec: SweepSpec, source: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """``(where in the spec, [assignment per value])`` per axis, in spec order."""
    axes: list[tuple[str, list[dict[str, Any]]]] = []
    if spec.num_chips:
        axes.append(("num_chips", [{"num_chips": v} for v in spec.num_chips]))
    for key, values in spec.overrides.items():
        axes.append((f"overrides.{key}", [{key: v} for v in values]))
    for g, group in enumerate(spec.zip):
        lengths = {k: len(v) for k, v in group.items()}
        if len(set(lengths.values())) > 1:
            raise InputError(f"the lists of a zip group vary together, so need one length, got {lengths}",
                             source=source, field=f"zip.{g}")
        n = next(iter(lengths.values()))
        axes.append((f"zip.{g}", [{k: group[k][j] for k in group} for j in range(n)]))
    return axes


def _check_keys(spec: SweepSpec, axes, workloads: list[_Base], systems: list[_Base], source: str) -> None:
    fixed = {k for k, v in spec.fixed.model_dump().items() if v is not None}
    seen: dict[str, str] = {}
    for where, values in axes:
        for key in values[0]:
            here = where if where in (key, f"overrides.{key}") else f"{where}.{key}"
            if key in seen or key in fixed:
                other = seen.get(key, f"fixed.{key}")
                raise InputError(f"is varied twice (also by {other})", source=source, field=here)
            seen[key] = here
            if key in KNOBS:
                for j, assignment in enumerate(values):
                    try:
                        FixedKnobs.model_validate({key: assignment[key]})
                    except Exception as exc:  # pydantic ValidationError: first message
                        msg = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
                        raise InputError(msg, source=source, field=f"{here}.{j}") from None
                continue
            head, _, rest = key.partition(".")
            if head not in ("system", "workload") or not rest:
                raise InputError(
                    f"expected system.<field path>, workload.<field path> or a knob ({', '.join(KNOBS)})",
                    source=source, field=here,
                )
            for base in systems if head == "system" else workloads:
                why = check_path(base.model, base.data, rest.split("."))
                if why:
                    raise InputError(f"{head} {base.label}: {why}", source=source, field=here)


def point_id(inputs: dict[str, Any], workload_data: dict, system_data: dict) -> str:
    """Stable hash of what determines a point's answer (contents, not labels or file names)."""
    blob = {
        "v": _ID_VERSION,
        "workload": workload_data,
        "system": system_data,
        "overrides": inputs["overrides"],
        "fixed": inputs["fixed"],
        "solver": inputs["solver"],
        "time_limit_s": inputs["time_limit_s"],
    }
    text = json.dumps(blob, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def expand(spec: str | Path | dict[str, Any] | SweepSpec) -> list[Point]:
    """The points of a sweep, in order (the last axis varies fastest); nothing is solved.

    >>> pts = expand({"workloads": ["gpt3_13b"], "systems": ["dgx_a100", "dgx_h100"],
    ...               "num_chips": [64, 128], "overrides": {"tp": [4, 8]}})
    >>> len(pts), pts[1].inputs["overrides"]
    (8, {'num_chips': 64, 'tp': 8})
    """
    spec, source, base_dir = load_spec(spec)
    workloads = _load_bases(spec.workloads, "workloads", source, base_dir)
    systems = _load_bases(spec.systems, "systems", source, base_dir)
    axes = _axes(spec, source)
    _check_keys(spec, axes, workloads, systems, source)
    fixed = {k: v for k, v in spec.fixed.model_dump().items() if v is not None}
    points: list[Point] = []
    seen: dict[str, int] = {}
    for w, s, *assignments in itertools.product(workloads, systems, *(values for _, values in axes)):
        overrides: dict[str, Any] = {}
        for a in assignments:
            overrides.update(a)
        inputs = {"workload": w.label, "system": s.label, "overrides": overrides, "fixed": fixed,
                  "solver": spec.solver, "time_limit_s": spec.time_limit_s}
        pid = point_id(inputs, w.data, s.data)
        if pid in seen:
            raise InputError(f"points {seen[pid]} and {len(points)} are the same (a workload, system or value is "
                             "listed twice)", source=source)
        seen[pid] = len(points)
        points.append(Point(len(points), pid, inputs, w.data, s.data))
    return points


# -- running one point --------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _solve(point: Point) -> dict[str, Any]:
    from dfmodel.graph.workload import load_workload
    from dfmodel.optimizer import optimize
    from dfmodel.system import load_system

    inputs = point.inputs
    data = {"system": copy.deepcopy(point.system_data), "workload": copy.deepcopy(point.workload_data)}
    knobs = dict(inputs["fixed"])
    for key, value in inputs["overrides"].items():
        head, _, rest = key.partition(".")
        if head in data and rest:
            _set_path(data[head], rest.split("."), value)
        else:
            knobs[key] = value
    loaded = {}
    for head, load in (("system", load_system), ("workload", load_workload)):
        try:
            loaded[head] = load(data[head])
        except InputError as exc:
            # say which sweep entry and which overridden field the bad value came from
            field_ = f"{head}.{exc.field}" if exc.field else head
            raise InputError(exc.message, source=f"{head} {inputs[head]}", field=field_) from None
    # each point's search is serial: the sweep's parallelism is over points (a pool or Ray
    # tasks of one CPU each), which keeps every core busy without nested process pools
    result = optimize(loaded["workload"], loaded["system"], **knobs, solver=inputs["solver"],
                      time_limit_s=inputs["time_limit_s"], workers=1)
    return result.to_dict()


def run_point(point: Point) -> dict[str, Any]:
    """Solve one point; any failure is recorded in the returned record, never raised.

    Unexpected exceptions are recorded too (with their type) so that one bad point cannot stop
    a long sweep; their type tells a model bug from an :class:`~dfmodel.errors.InputError`.
    """
    t0 = time.perf_counter()
    result, error = None, None
    try:
        result = _solve(point)
    except Exception as exc:  # noqa: BLE001 -- recorded, see docstring
        error = {"type": type(exc).__name__, "message": _one_line(exc)}
    return {"id": point.id, "index": point.index, "inputs": point.inputs, "result": result, "error": error,
            "wall_s": round(time.perf_counter() - t0, 6)}


# -- the results file -----------------------------------------------------------------------------


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The complete records of a results file, in file order.

    A line that is not valid JSON is skipped: the last one is what a kill mid-write leaves behind.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    out = []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "id" in rec:
            out.append(rec)
    return out


class _Writer:
    """Appends one record per line: whole line in one write, flushed and fsynced at once."""

    def __init__(self, path: Path, resume: bool):
        self.path = path
        if path.exists() and path.stat().st_size and not resume:
            raise InputError("already exists; pass --resume (resume=True) to finish it, or choose another file",
                             source=str(path), field="out")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "ab")  # noqa: SIM115 -- closed in close()
        try:
            import fcntl

            fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock (Windows): the lock is only a guard against mistakes
            pass
        except OSError:
            self.f.close()
            raise InputError("another sweep is writing this file", source=str(path), field="out") from None
        self._repair_tail()

    def _repair_tail(self) -> None:
        """A kill mid-write leaves a last line without its newline: drop it (or end it if whole)."""
        with open(self.path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
            cut = data.rfind(b"\n") + 1
            try:
                json.loads(data[cut:])
                whole = True
            except ValueError:
                whole = False
            if whole:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            else:
                f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        self.f.write(line.encode())
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


# -- executors --------------------------------------------------------------------------------------


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group; the driver alone handles it (and stops the workers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A driver killed with SIGKILL cannot stop its pool, and idle workers would wait for work
    # forever: leave as soon as we are re-parented.
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="dfmodel-parent-watch", daemon=True).start()


class _Inline:
    """One worker: run the points in this process (no pool to start; easy to debug)."""

    def __init__(self, points: list[Point]):
        self.points = points

    def start(self) -> None:
        pass

    def results(self) -> Iterator[dict[str, Any]]:
        for p in self.points:
            yield run_point(p)

    def close(self, cancel: bool) -> None:
        pass


class _Processes:
    """A ProcessPoolExecutor on this machine."""

    def __init__(self, points: list[Point], workers: int):
        self.points, self.workers = points, workers
        self.pool = None
        self.futures: list = []

    def start(self) -> None:
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(max_workers=self.workers, initializer=_worker_init)
        # submit before the progress bar's thread starts: with fork, workers are created here
        self.futures = [self.pool.submit(run_point, p) for p in self.points]

    def results(self) -> Iterator[dict[str, Any]]:
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        for fut in as_completed(self.futures):
            try:
                yield fut.result()
            except BrokenProcessPool as exc:
                raise _WorkerLost(_one_line(exc) or "a worker process died") from None

    def close(self, cancel: bool) -> None:
        if self.pool is None:
            return
        if cancel:
            for fut in self.futures:
                fut.cancel()
            # running points cannot be cancelled; stop our own workers rather than wait for them
            for proc in list((getattr(self.pool, "_processes", None) or {}).values()):
                proc.terminate()
        self.pool.shutdown(wait=True, cancel_futures=cancel)


class _Ray:
    """Ray tasks on an existing cluster (``address``) or a local Ray instance; the driver writes."""

    def __init__(self, points: list[Point], workers: int | None, address: str | None):
        self.points, self.workers, self.address = points, workers, address
        self.started_ray = False
        self.pending: dict = {}

    def start(self) -> None:
        try:
            import ray
        except ImportError:
            raise InputError("Ray is not installed: pip install 'dfmodel[ray]'", field="executor") from None
        self.ray = ray
        if not ray.is_initialized():
            local = {"include_dashboard": False}
            if self.workers:
                local["num_cpus"] = self.workers
            why = _unreachable(self.address) if self.address else None
            if self.address and why is None:
                try:
                    ray.init(address=self.address)
                except Exception as exc:  # noqa: BLE001 -- any failure to connect: run locally
                    why = _one_line(exc)
            if why:
                print(f"warning: cannot connect to Ray at {self.address} ({why}); starting a local Ray instance",
                      file=sys.stderr)
            if not ray.is_initialized():
                ray.init(**local)
            self.started_ray = True
        self.task = ray.remote(num_cpus=1)(run_point)
        self.queue = list(self.points)
        # a bounded number in flight when --workers is given, else all (Ray schedules them)
        self.limit = self.workers or len(self.points)
        self._fill()

    def _fill(self) -> None:
        while self.queue and len(self.pending) < self.limit:
            p = self.queue.pop(0)
            self.pending[self.task.remote(p)] = p

    def results(self) -> Iterator[dict[str, Any]]:
        ray = self.ray
        while self.pending:
            done, _ = ray.wait(list(self.pending), num_returns=1)
            ref = done[0]
            self.pending.pop(ref)
            try:
                rec = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 -- a worker or node died (run_point never raises)
                raise _WorkerLost(_one_line(exc)) from None
            self._fill()
            yield rec

    def close(self, cancel: bool) -> None:
        ray = getattr(self, "ray", None)
        if ray is None:
            return
        if cancel:
            for ref in self.pending:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 -- best effort on the way out
                    pass
        if self.started_ray:
            ray.shutdown()


def _unreachable(address: str, timeout_s: float = 3.0) -> str | None:
    """Why nothing listens at a Ray ``host:port`` / ``ray://host:port`` address; None if something does.

    ray.init retries an unreachable head for many minutes; a TCP probe fails in seconds, so the
    sweep can fall back to a local instance at once. ``auto`` and ``local`` are left to Ray.
    """
    import socket

    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{hostport}: {exc.strerror or exc}"


class _WorkerLost(Exception):
    """An executor lost a worker (not a point's own error): stop; --resume picks up from here."""


def default_workers() -> int:
    """One worker per core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# -- the sweep ----------------------------------------------------------------------------------------


def sweep(
    spec: str | Path | dict[str, Any] | SweepSpec,
    *,
    out: str | Path | None = None,
    workers: int | None = None,
    resume: bool = False,
    executor: str = "process",
    address: str | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every point of ``spec`` (one ``optimize`` each); records in point order.

    ``out``: JSON-lines file each finished record is appended to at once (it must not exist
    or be empty unless ``resume``). ``resume``: skip the points whose id is already in ``out``
    (their records come from the file). ``workers``: points in parallel (default one per core;
    1 runs them in this process). ``executor``: ``"process"`` (this machine) or ``"ray"`` (tasks
    on the cluster at ``address``, else a local Ray instance; dfmodel must be installed on its
    nodes). A failing point records ``error`` and the sweep goes on.

    With the process executor on a platform that spawns workers (macOS, Windows), call it from
    under ``if __name__ == "__main__":`` as for any multiprocessing code.

    >>> recs = sweep({"workloads": ["gpt3_13b"], "systems": ["dgx_a100"],       # doctest: +SKIP
    ...               "num_chips": [64, 128]}, out="r.jsonl", workers=2)
    >>> [r["result"]["iteration_time_s"] for r in recs]                       # doctest: +SKIP
    """
    if executor not in EXECUTORS:
        raise InputError(f"must be process or ray, got {executor!r}", field="executor")
    if workers is not None and workers < 1:
        raise InputError(f"must be >= 1, got {workers}", field="workers")
    points = expand(spec)
    records: dict[int, dict[str, Any]] = {}
    writer = None
    if out is not None:
        out = Path(out)
        if resume and out.exists():
            done = {rec["id"]: rec for rec in read_records(out)}
            for p in points:
                if p.id in done:
                    records[p.index] = {**done[p.id], "index": p.index}
        writer = _Writer(out, resume)
    todo = [p for p in points if p.index not in records]

    if executor == "ray":
        runner: Any = _Ray(todo, workers, address)
    else:
        n = min(workers or default_workers(), len(todo))
        runner = _Inline(todo) if n <= 1 else _Processes(todo, n)

    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    bar = Progress(
        TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not progress,
    )
    cancel = True
    try:
        if todo:
            runner.start()
        # resumed points count as done, but not in the rate the ETA is computed from
        with bar:
            task = bar.add_task("sweep", total=len(points), completed=len(records), failed=0)
            failed = sum(1 for r in records.values() if r.get("error"))
            for rec in runner.results() if todo else ():
                if writer is not None:
                    writer.write(rec)
                records[rec["index"]] = rec
                failed += rec["error"] is not None
                bar.update(task, advance=1, failed=failed)
        cancel = False
    except _WorkerLost as exc:
        saved = f"; the finished points are in {out}, run again with --resume to finish" if out else ""
        raise DFModelError(f"sweep stopped: a worker was lost ({exc}){saved}") from None
    finally:
        runner.close(cancel=cancel)
        if writer is not None:
            writer.close()
    return [records[p.index] for p in points]


def summary(records: list[dict[str, Any]], out: str | Path | None = None) -> str:
    """One line: how many points, how many failed and why.

    >>> summary([{"error": None}, {"error": {"type": "InfeasibleError", "message": "m"}}])
    '2 points: 1 ok, 1 failed (InfeasibleError 1)'
    """
    errors = Counter(r["error"]["type"] for r in records if r.get("error"))
    failed = sum(errors.values())
    text = f"{len(records)} points: {len(records) - failed} ok, {failed} failed"
    if errors:
        text += " (" + ", ".join(f"{k} {v}" for k, v in errors.most_common()) + ")"
    return text + (f"; results in {out}" if out else "")


# -- reading results back -------------------------------------------------------------------------------


def _flatten(d: dict[str, Any], prefix: str, row: dict[str, Any]) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _flatten(v, key + ".", row)  # an empty dict adds no column
        else:
            row.setdefault(key, v)  # an input column of the same name (num_chips) wins


def record_row(rec: dict[str, Any]) -> dict[str, Any]:
    """One flat row: inputs, error, then the result's keys joined with dots.

    >>> record_row({"id": "x", "index": 0, "inputs": {"workload": "w", "system": "s",
    ...     "overrides": {"tp": 2}, "fixed": {}}, "error": None, "wall_s": 1.0,
    ...     "result": {"workload": "w", "breakdown_s": {"compute": 0.5}}})
    {'id': 'x', 'index': 0, 'workload': 'w', 'system': 's', 'tp': 2, 'error_type': None, 'error': None, 'wall_s': 1.0, 'breakdown_s.compute': 0.5}
    """
    inputs = rec.get("inputs", {})
    err = rec.get("error")
    row: dict[str, Any] = {"id": rec.get("id"), "index": rec.get("index"),
                           "workload": inputs.get("workload"), "system": inputs.get("system")}
    row.update(inputs.get("overrides", {}))
    row.update({f"fixed.{k}": v for k, v in inputs.get("fixed", {}).items()})
    row["error_type"] = err["type"] if err else None
    row["error"] = f"{err['type']}: {err['message']}" if err else None
    row["wall_s"] = rec.get("wall_s")
    result = dict(rec.get("result") or {})
    # the result's workload/system are the specs' names; the input labels above identify the point
    result.pop("workload", None)
    result.pop("system", None)
    # one column per knob value would swamp the table: the why-not table stays in the JSON record
    result.pop("why_not", None)
    _flatten(result, "", row)
    return row


def load_results(path: str | Path):
    """A results file as a ``pandas.DataFrame``: one row per point, sorted by point index.

    Columns: ``id``, ``index``, ``workload``, ``system``, one per override key (``num_chips``,
    ``system.chip.memory.bandwidth_Bps``, ``tp`` ...), ``fixed.<knob>``, ``error_type``,
    ``error`` (``"Type: message"``, None when it ran), ``wall_s``, then the result flattened
    (``iteration_time_s``, ``parallelism.tp``, ``breakdown_s.compute``,
    ``throughput.samples_per_s``, ``throughput_per_usd``, ``solver.status`` ...). A point
    recorded twice (re-run after an edit of the file) keeps its last record.

    >>> df = load_results("results.jsonl")                                   # doctest: +SKIP
    >>> ok = df[df.error.isna()]                                             # doctest: +SKIP
    >>> ok.plot.scatter("system.chip.memory.bandwidth_Bps", "iteration_time_s")  # doctest: +SKIP
    """
    try:
        import pandas as pd
    except ImportError:
        raise DFModelError("load_results needs pandas: pip install pandas") from None
    latest: dict[str, dict[str, Any]] = {}
    for rec in read_records(path):
        latest.pop(rec["id"], None)
        latest[rec["id"]] = rec
    rows = [record_row(r) for r in latest.values()]
    df = pd.DataFrame(rows)
    if len(df) and "index" in df:
        df = df.sort_values("index", kind="stable").reset_index(drop=True)
    return df


__all__ = ["sweep", "load_results", "expand", "run_point", "read_records", "summary", "SweepSpec", "Point"]
