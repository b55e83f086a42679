"""`jaxrl-llm plan --config X`: compile the train step for the config's full model and mesh
without weights or devices, and print what each device would hold (`plan.make_plan`)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=True)
    parser.add_argument("--topology", help="override plan.topology, e.g. v5e:16x16")
    parser.add_argument("--platform", choices=("cpu", "tpu"), help="override plan.platform")
    parser.add_argument("--json", dest="json_path", help="also write the report as JSON here")
    parser.add_argument("--top", type=int, default=8, help="how many largest arrays to list")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.commands.config import load_experiment_config
    from jaxrl_llm.core.atomic import atomic_write_text
    from jaxrl_llm.plan import PlanOutOfMemory, format_report, host_device_count, make_plan

    overrides = list(args.overrides)
    if args.topology:
        overrides.append(f"plan.topology={args.topology}")
    if args.platform:
        overrides.append(f"plan.platform={args.platform}")
    from jaxrl_llm.commands.config import pick_schema, schema_class, top_level_keys
    from jaxrl_llm.config import load_config

    if pick_schema(top_level_keys(args.config, overrides)) == "online":
        # kept whole: its online: section says where the sampler runs (plan/sampler.py)
        config = load_config(args.config, overrides, schema=schema_class("online"))
    else:
        config = load_experiment_config(args.config, overrides)
    count = host_device_count(config)
    if count is not None:
        # Read by XLA when jax first initialises its CPU backend (not yet, in this process).
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        report = make_plan(config, top=args.top)
    except PlanOutOfMemory as err:
        print(f"DOES NOT FIT: {err}")
        return 1
    print(format_report(report), end="")
    if args.json_path:
        data = asdict(report) | {"peak_bytes": report.peak_bytes, "fits": report.fits,
                                 "roofline_seconds": report.roofline_seconds,
                                 "mfu_bound": report.mfu_bound}
        atomic_write_text(args.json_path, json.dumps(data, indent=2))
    return 0 if report.fits is not False else 1
