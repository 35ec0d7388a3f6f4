"""How far apart published runs of the SAME configuration are (issue 11): the floor under any
model's error on published step times.

Every shipped calibration dataset is read; cases that publish the same configuration -- the
model's shape, global and micro batch, precision, chip, chip count and the tp / pp / cp / dp / ep
degrees -- are grouped, whatever else their records state or leave out (framework release,
knobs one source names and another does not; a knob both name must agree: recompute, sequence
parallelism, interleave, FP8 recipe). For each group with two or more measured step
times the script prints them and their spread, ``max / min - 1``: two releases of the same
framework on the same machine (NeMo 24.07 against the dgxc-benchmarking NeMo 24.09 runs, for
instance) differ by that much, so no model of the hardware can be closer than about half of it
to both.

Run: PYTHONPATH=. python benchmarks/noise_floor.py [DATASET ...]   (default: every shipped one)
"""

from __future__ import annotations

import sys
from collections import defaultdict

from dfmodel.validate import Case, load_cases, resolve_cases

#: the LLM datasets (other_families.yaml holds DLRM / HPL / FFT records of another schema)
DATASETS = ("h100_training", "h100_holdout", "megatron_core_h100", "megatron_bridge_h100", "moe_training",
            "megatron_a100")


def config_key(c: Case) -> tuple:
    """What makes two published runs the same configuration (see the module docstring)."""
    m, t, p = c.model, c.training, c.parallelism
    # (one record gives the tokenizer's vocabulary, another Megatron's padding of it to a multiple
    # of 128 x tp, --make-vocab-size-divisible-by: compared up to 128 x 8)
    vocab = -(-m.vocab_size // 1024)
    return (m.hidden, m.num_heads, m.num_kv_heads, m.num_layers, m.seq_len, m.ffn_hidden, m.ffn_type,
            vocab, m.moe is not None, t.global_batch, t.micro_batch, t.precision, c.system.chip,
            c.system.num_chips, p.tp, p.pp, p.cp, p.dp, p.ep)


#: knobs a case may leave out; two cases that both name one must name the same value
STATED_KNOBS = (("parallelism", "activation_recompute"), ("parallelism", "sequence_parallel"),
                ("parallelism", "virtual_pipeline"), ("training", "fp8_recipe"))


def stated_knobs(c: Case) -> dict[str, object]:
    """The :data:`STATED_KNOBS` the case names (None: left out)."""
    return {k: getattr(getattr(c, part), k) for part, k in STATED_KNOBS if getattr(getattr(c, part), k) is not None}


def agree(a: Case, b: Case) -> bool:
    """Whether no knob named by both cases differs."""
    ka, kb = stated_knobs(a), stated_knobs(b)
    return all(ka[k] == kb[k] for k in ka.keys() & kb.keys())


def same_config_groups(names: list[str]) -> list[list[tuple[str, Case]]]:
    """Groups of (dataset, case) publishing one configuration, two or more cases each: same
    :func:`config_key`, and each case agreeing (:func:`agree`) with the group's first.

    >>> groups = same_config_groups(["h100_training", "h100_holdout"])
    >>> any({c.id for _, c in g} >= {"nemo2407-llama3-8b-fp8-8", "dgxc-llama31-8b-fp8-8"} for g in groups)
    True
    """
    by_key: dict[tuple, list[tuple[str, Case]]] = defaultdict(list)
    for name in names:
        for c in load_cases(resolve_cases(name)):
            by_key[config_key(c)].append((name, c))
    groups: list[list[tuple[str, Case]]] = []
    for members in by_key.values():
        while members:
            first = members[0][1]
            group = [m for m in members if agree(first, m[1])]
            members = [m for m in members if not agree(first, m[1])]
            groups.append(group)
    return [g for g in groups if len(g) > 1]


def spread(group: list[tuple[str, Case]]) -> float:
    """``max / min - 1`` of the group's measured step times."""
    times = [c.measured.iteration_time_s for _, c in group]
    return max(times) / min(times) - 1


def main(names: list[str]) -> None:
    groups = sorted(same_config_groups(names), key=spread, reverse=True)
    if not groups:
        print("no two cases publish the same configuration")
        return
    for g in groups:
        print(f"spread {spread(g):6.1%}")
        for name, c in g:
            print(f"    {c.measured.iteration_time_s:9.3f} s  {name:20s} {c.id}")
    spreads = [spread(g) for g in groups]
    print(f"{len(groups)} configurations published more than once: spread mean {sum(spreads) / len(spreads):.1%}, "
          f"max {max(spreads):.1%}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(DATASETS))
