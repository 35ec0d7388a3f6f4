"""Calibrate one set of GLOBAL efficiency factors per system preset and report its fidelity
in-sample and cross-validated by leaving one model family out (issue 11).

For each preset a small grid of global factors is evaluated once on every case of its dataset
(the same value for every case, never per case); then

- in-sample: the grid point with the least mean |error| over all cases;
- leave-one-family-out (LOFO): for each model family (cases with the same architecture), the
  grid point fitted on the OTHER families predicts the held-out family's cases; the figures are
  the mean / max |error| of those held-out predictions.

Datasets (the shipped calibration/ folder, or the folder given):
- dgx_a100: megatron_a100.yaml (18 Megatron-LM runs, 2021-2022). Those runs predate
  FlashAttention in Megatron-LM (Narayanan et al. SC21; Korthikanti et al. 2022 use the unfused
  core attention with a fused scale-mask-softmax kernel), so they are evaluated with
  ``attention: unfused``.
- dgx_h100 / dgx_h200 / dgx_b200: h100_training.yaml (NeMo / MLPerf, FlashAttention). Cases that
  need context parallelism are skipped with the reason until the build supports ``cp``; they are
  picked up automatically after that. The tensor-core factors are fitted once (on the H100 runs'
  physics, over all cases of the file) and reach the H200 / B200 presets through
  :data:`GEMM_FRACTION_OF_PEAK`, so a held-out family never leaves a chip with a free factor.

Run: PYTHONPATH=. python benchmarks/calibrate.py [--quick] [CALIBRATION_DIR]
The chosen factors are copied into systems/*.yaml by hand, with this script named as the source.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections import defaultdict
from pathlib import Path

from dfmodel.presets import resolve
from dfmodel.validate import evaluate_case, load_cases, system_of
from dfmodel.yamlio import read_yaml

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ONLY = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")), None)  # one preset
QUICK = "--quick" in sys.argv
DATA = Path(ARGS[0]) if ARGS else Path(__file__).resolve().parents[1] / "calibration"

#: Global factors searched per preset (chip.efficiency keys; matmul per precision as "matmul.fp8").
GRIDS = {
    "dgx_a100": {"matmul.bf16": [0.6, 0.65, 0.7], "memory": [0.7, 0.85]},
    # attention stays at the preset's FlashAttention figure (FA-3 paper); with tp_comm_overlap wired
    # the runs' TP communication is hidden, so the GEMM factors are searched lower than before
    # fp8 searched higher since TE's cast/transpose kernels are their own (memory-bound) term
    "dgx_h100": {"matmul.bf16": [0.6, 0.625, 0.65], "matmul.fp8": [0.5, 0.525, 0.55, 0.575, 0.6, 0.625],
                 # fused attention is a global factor of its own (issue 11): FA-2 ~35 %, FA-3 / cuDNN
                 # ~50-65 % of the bf16 peak forward, less backward (Shah et al. 2024, sec. 4)
                 "attention": [0.3, 0.35, 0.4]},
}

#: Large-GEMM fraction of the dense tensor-core peak each chip reaches in published cuBLAS
#: benchmarks at one shape (torch.matmul, bf16, M = N = K = 8192, so every chip runs the same
#: problem): the per-chip ratio that carries the Hopper fit to another chip, so that no factor is
#: fitted on that chip's own runs (issue 11: a B200 prediction must not rest on B200 cases).
#: - H100 SXM5: 797.51 of 989 TFLOPS (zzc0721/torch-performance-test-data issue #79, "NVIDIA H100
#:   80GB HBM3", PyTorch 2.7.0+cu128, 2025-10-18); the H200 is the same GH100 die at the same 700 W.
#: - B200: 1.42e15 of 2.25e15 FLOP/s, pct_peak 0.631 (pytorch/ao PR #2427, benchmarks/float8/
#:   bench_matmul.py on "NVIDIA B200", 2025-06-23; 4096: 0.627, 6144: 0.646). The 1000 W part does
#:   not hold the clock its datasheet peak assumes under dense tensor-core load. FP8 agrees: TE.Linear
#:   FP8 at 8192^3 reaches 2377 of 4500 TFLOPS (0.528; NVIDIA/TransformerEngine issue #1747,
#:   2025-05-03), ~0.78 of what H100 FP8 GEMMs reach of their peak (~0.65-0.71), so one ratio serves
#:   both precisions. (S. Bekman's best-shape MAMF table, ml-engineering compute/accelerator, gives
#:   B200 77.6 % bf16 / 76.3 % fp8 against H100 80.3 % / 70.9 %: a brute-force maximum over short
#:   runs, which its author notes may not pin the sustained clock; not used here.)
GEMM_FRACTION_OF_PEAK = {"dgx_h100": 797.51 / 989.0, "dgx_h200": 797.51 / 989.0, "dgx_b200": 1.42e15 / 2.25e15}
#: The preset whose training runs the tensor-core factors are fitted on.
FIT_PRESET = "dgx_h100"


def tensor_core_scale(preset: str) -> float:
    """Multiplier that carries a matmul factor fitted on :data:`FIT_PRESET` to ``preset``: the
    ratio of their published large-GEMM fractions of peak (1 for a preset not listed)."""
    ref = GEMM_FRACTION_OF_PEAK[FIT_PRESET]
    return GEMM_FRACTION_OF_PEAK.get(preset, ref) / ref


#: The V100 cluster preset serves only the network-bound FFT cases: its two network
#: efficiencies (host-staged PCIe inside a node, FDR between nodes) are its global factors.
FFT_GRID = {"pcie": [0.15, 0.18, 0.2], "ib": [0.3, 0.35, 0.4]}
if QUICK:
    GRIDS = {"dgx_a100": {"matmul.bf16": [0.65]}, "dgx_h100": {"matmul.bf16": [0.75]}}
    FFT_GRID = {"pcie": [0.18], "ib": [0.35]}

DATASETS = {
    "dgx_a100": ("megatron_a100.yaml", {"attention": "unfused"}),
    "dgx_h100": ("h100_training.yaml", None),  # also its H200 / B200 cases, on their presets
}


def family(case) -> str:
    """Model family of a case: the architecture (MLP type, hidden size, layers)."""
    m = case.model
    return f"{m.ffn_type}-h{m.hidden}-L{m.num_layers}"


def relevant(factor: str, case) -> bool:
    """Whether a grid factor can change a case's prediction (``matmul.fp8`` only FP8 runs;
    ``<preset>/<key>`` only the cases on that preset)."""
    if "/" in factor:
        preset, factor = factor.split("/", 1)
        if system_of(case.system.chip) != preset:
            return False
    if factor.startswith("matmul."):
        prec = factor.split(".", 1)[1]
        case_prec = "fp8" if case.training.precision == "fp8" else "bf16"
        return prec == case_prec or (prec == "bf16" and case_prec == "fp8")  # fp8 runs also use bf16
    return True


def system_with(preset: str, factors: dict) -> dict:
    """The preset with the factors set; ``matmul.<p>`` turns a scalar matmul into a table and is
    carried to the preset by :func:`tensor_core_scale` (B200: the Hopper fit times the published
    GEMM ratio); ``<preset>/<key>`` applies to that preset only, unscaled (after the shared ones;
    None: keep shared)."""
    s = copy.deepcopy(read_yaml(resolve(preset, "systems")))
    eff = s["chip"]["efficiency"]
    shared = [(k, v) for k, v in factors.items() if "/" not in k]
    own = [(k.split("/", 1)[1], v) for k, v in factors.items() if "/" in k and k.split("/", 1)[0] == preset
           and v is not None]
    scale = tensor_core_scale(preset)
    shared = [(k, v * scale if k.startswith("matmul.") and k != "matmul.fp64" else v) for k, v in shared]
    for key, value in shared + own:
        if key.startswith("matmul."):
            prec = key.split(".", 1)[1]
            if not isinstance(eff.get("matmul"), dict):
                base = eff.get("matmul", 1.0)
                eff["matmul"] = {p: base for p in s["chip"]["peak_flops"]} if isinstance(
                    s["chip"]["peak_flops"], dict) else {prec: base}
            eff["matmul"][prec] = value
            if prec == "bf16" and "fp16" in eff["matmul"]:
                eff["matmul"]["fp16"] = value  # the same tensor-core rate (dense peaks are equal)
        else:
            eff[key] = value
    return s


def evaluate_grid(preset: str, cases, overrides) -> list[tuple[dict, dict]]:
    """[(factors, {case id: (error, row)})] for every grid point; cases on other chips use their
    own preset with the same factors (H200 shares Hopper's; B200's matmul factors are Hopper's
    times :func:`tensor_core_scale`)."""
    grid = GRIDS.get(preset, {})
    points = []
    cache: dict[tuple, object] = {}
    for values in itertools.product(*grid.values()):
        factors = dict(zip(grid, values))
        rows = {}
        for c in cases:
            target = system_of(c.system.chip)
            # a factor of another precision cannot change a case: evaluate once per relevant set
            key = (c.id, tuple((k, v) for k, v in factors.items() if relevant(k, c)))
            if key not in cache:
                cache[key] = evaluate_case(c, system_with(target, factors), workload_overrides=overrides)
            rows[c.id] = cache[key]
        errs = [abs(r.error) for r in rows.values() if r.error is not None]
        mean = sum(errs) / len(errs) if errs else float("nan")
        print(f"  {preset} {factors}  evaluated {len(errs)}/{len(rows)}  mean |err| {mean:.1%}", flush=True)
        points.append((factors, rows))
    return points


def fit(points, ids) -> tuple[dict, dict]:
    """The grid point with the least mean |error| over the cases ``ids``."""
    def score(p):
        errs = [abs(p[1][i].error) for i in ids if p[1][i].error is not None]
        return sum(errs) / len(errs) if errs else float("inf")
    return min(points, key=score)


def stats(errors: list[float]) -> str:
    if not errors:
        return "no evaluable case"
    a = [abs(e) for e in errors]
    return f"mean |err| {sum(a) / len(a):.1%}  max {max(a):.1%}  bias {sum(errors) / len(errors):+.1%}  (n={len(a)})"


#: A factor whose grid values move no training case's prediction by more than this (relative to
#: the measured time) is not identified by those cases: the fit's choice of it is arbitrary.
IDENTIFIED_REL = 0.005


def unidentified(points, fitted: dict, ids) -> list[str]:
    """Factors of ``fitted`` that no case of ``ids`` is sensitive to: over the factor's grid values
    (the other factors as fitted) every case's prediction stays within :data:`IDENTIFIED_REL`.
    E.g. the FP8 GEMM efficiency when every FP8 training run is host-bound (chip
    ``efficiency.host_linear_s``): its held-out predictions then rest on an arbitrary grid value."""
    blind = []
    for factor in fitted:
        rows = [p[1] for p in points if all(p[0][k] == v for k, v in fitted.items() if k != factor)]
        spread = 0.0
        for i in ids:
            preds = [r[i].predicted_s for r in rows if r[i].error is not None]
            if preds:
                spread = max(spread, (max(preds) - min(preds)) / rows[0][i].measured_s)
        if spread <= IDENTIFIED_REL:
            blind.append(factor)
    return blind


def shipped_factors(preset: str, points) -> dict | None:
    """The grid point that equals the preset's shipped efficiency (systems/<preset>.yaml), if any."""
    eff = read_yaml(resolve(preset, "systems"))["chip"]["efficiency"]

    def value(key):
        if key.startswith("matmul."):
            m = eff.get("matmul")
            return m.get(key.split(".", 1)[1]) if isinstance(m, dict) else m
        return eff.get(key)

    for factors, _ in points:
        if all("/" in k or v is None or value(k) == v for k, v in factors.items()):
            return factors
    return None


def report(preset: str, cases, points) -> None:
    evaluable = [c.id for c in cases if points[0][1][c.id].error is not None]
    skipped = [(c.id, points[0][1][c.id].message) for c in cases if points[0][1][c.id].error is None]
    factors, rows = fit(points, evaluable)
    print(f"\n== {preset}: in-sample fit {factors}")
    for c in cases:
        r = rows[c.id]
        if r.error is None:
            continue
        picked = " ".join(f"{k}={v}" for k, v in r.chosen.items())
        print(f"  {c.id:42s} {r.system:10s} {r.mapping:34s} pred {r.predicted_s:8.3f} s  meas {r.measured_s:8.3f} s"
              f"  {r.error:+.1%}  [{picked}]")
    print(f"  in-sample: {stats([rows[i].error for i in evaluable])}")
    shipped = shipped_factors(preset, points)
    if shipped is not None:
        rows_s = dict(next(p for p in points if p[0] == shipped)[1])
        errs = {i: rows_s[i].error for i in evaluable}
        worst = max(errs, key=lambda i: abs(errs[i]))
        print(f"  at the shipped factors {shipped}: {stats(list(errs.values()))}  worst {worst} {errs[worst]:+.1%}")
    fams = defaultdict(list)
    for c in cases:
        if c.id in evaluable:
            fams[family(c)].append(c.id)
    held = []
    if len(fams) > 1:
        for fam, ids in fams.items():
            train = [i for i in evaluable if i not in ids]
            f_fit, _ = fit(points, train)
            rows_f = dict(next(p for p in points if p[0] == f_fit)[1])
            errs = [rows_f[i].error for i in ids]
            held += errs
            worst = max(ids, key=lambda i: abs(rows_f[i].error))
            print(f"  LOFO {fam:28s} fitted {f_fit} -> {stats(errs)}  worst {worst} {rows_f[worst].error:+.1%}")
            blind = unidentified(points, f_fit, train)
            if blind:
                print(f"       {'':28s} unidentified by the training families (a grid value, not a fit): {', '.join(blind)}")
        print(f"  leave-one-family-out: {stats(held)}")
    else:
        print("  leave-one-family-out: needs two or more evaluable families")
    for cid, msg in skipped:
        print(f"  skipped {cid}: {msg}")


def other_families() -> None:
    """DLRM / HPL on the calibrated presets (nothing fitted to them) and the FFT cases on the
    V100 preset with its network efficiencies fitted (in-sample and leave-one-case-out)."""
    from dfmodel.validate import evaluate_family_case, load_family_cases

    path = DATA / "other_families.yaml"
    if not path.exists():
        print(f"other families: {path} not found, skipped")
        return
    cases = load_family_cases(path)
    print(f"\n== other families: {len(cases)} cases from {path}")
    for c in cases:
        if c.family == "fft":
            continue
        r = evaluate_family_case(c)
        rng = f"  range {r.range_s[0]:.4g}..{r.range_s[1]:.4g} s" if r.range_s else ""
        err = f"{r.error:+.1%}" if r.error is not None else r.message[:120]
        print(f"  {c.id:32s} {r.system:10s} pred {r.predicted_s or 0:10.4g} s  meas {r.measured_s:10.4g} s  {err}"
              f"  [{' '.join(f'{k}={v}' for k, v in r.chosen.items())}]{rng}")
    fft = [c for c in cases if c.family == "fft"]
    points = []
    for pcie, ib in itertools.product(FFT_GRID["pcie"], FFT_GRID["ib"]):
        s = copy.deepcopy(read_yaml(resolve("v100_fdr", "systems")))
        s["network"][0]["efficiency"], s["network"][1]["efficiency"] = pcie, ib
        rows = {c.id: evaluate_family_case(c, s) for c in fft}
        errs = [abs(r.error) for r in rows.values() if r.error is not None]
        print(f"  v100_fdr pcie {pcie} ib {ib}: mean |err| {sum(errs) / max(1, len(errs)):.1%}", flush=True)
        points.append(({"pcie": pcie, "ib": ib}, rows))
    ids = [c.id for c in fft]
    f_all, rows = fit(points, ids)
    print(f"  FFT in-sample fit {f_all}")
    for i in ids:
        r = rows[i]
        print(f"    {i:32s} {r.mapping:22s} pred {r.predicted_s:8.4f} s  meas {r.measured_s:8.4f} s  {r.error:+.1%}")
    print(f"  FFT in-sample: {stats([rows[i].error for i in ids])}")
    held = []
    for i in ids:
        f_i, _ = fit(points, [j for j in ids if j != i])
        held.append(dict(next(p for p in points if p[0] == f_i)[1])[i].error)
    print(f"  FFT leave-one-case-out (one family only): {stats(held)}")


def main() -> None:
    for preset, (fname, overrides) in DATASETS.items():
        if ONLY and preset != ONLY:
            continue
        path = DATA / fname
        if not path.exists():
            print(f"{preset}: {path} not found, skipped")
            continue
        cases = load_cases(path)
        print(f"{preset}: {len(cases)} cases from {path}", flush=True)
        report(preset, cases, evaluate_grid(preset, cases, overrides))
    if not ONLY:
        other_families()


if __name__ == "__main__":
    main()
