"""The trainer section's lines in bench.md: where a Composer batch's time goes, what Composer adds as a run
runs it (issue 30 item 5), and the recipe's own trainer (its FSDP and microbatch) against the step section."""

from __future__ import annotations

from typing import Any

OUTSIDE_SHARE = 0.10  # Composer's time outside the bare step
FLOW_ADDED_TARGET = 0.05  # issue 30 item 5: what the Composer batch may add to its step, as a run runs it
LISTED_COMPONENTS = 3  # the costliest Composer algorithms / callbacks named in the findings
ALWAYS_LISTED = ("GradNormClipping", "HandoffEMA")  # named even when not among the costliest
# the recipe's batches below this share of the step section's images/s: the bench's headline MFU is not
# what a run of the recipe gets, and the finding says so
AS_RECIPE_SHARE = 0.8
WRAPPED, BARE = "fsdp_per_block", "no_fsdp"  # trainer.host_twin's two runs (train/bench/trainer/host.py)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.1f} ms"


def trainer_findings(trainer: dict[str, Any], train: dict[str, Any]) -> list[str]:
    """`train`: the step section's entries by resolution, which the recipe's own batches are read against."""
    components = trainer["components_s"]
    largest = sorted(components.items(), key=lambda item: -item[1])[:LISTED_COMPONENTS]
    # issue 30 (5): clipping and the EMA are always named, each with its own time
    always = [(name, components[name]) for name in ALWAYS_LISTED if name in components]
    shown = largest + [item for item in always if item not in largest]
    parts = ", ".join(f"{name} {_ms(s)}" for name, s in shown)
    flow = trainer.get("flow")
    # the target is read on the flow batches when measured: timing the parts serialises the batch
    flag = " - above target" if not flow and trainer["outside_step_share"] > OUTSIDE_SHARE else ""
    notes = [
        f"Composer trainer: {trainer['python_side_share']:.1%} of each batch is outside its forward, "
        f"backward and optimizer step (data fetch {_ms(trainer['data_fetch_s'])}; {parts}; "
        f"Composer's own loop {_ms(trainer['unattributed_s'])}); against a separate bare step "
        f"{trainer['outside_step_share']:.1%}{flag} (each part timed to the device: serialised)"
    ]
    if flow:
        flag = " - above target" if flow["outside_share"] > FLOW_ADDED_TARGET else ""
        notes.append(
            f"Composer trainer as a run runs it (no wait for the device inside a batch): "
            f"{_ms(flow['composer_per_batch_s'])} a batch against {_ms(flow['bare_per_step_s'])} a bare step "
            f"back to back, {flow['outside_share']:.1%} added (target < {FLOW_ADDED_TARGET:.0%}){flag}"
        )
    for res, as_run in trainer.get("as_recipe", {}).items():
        notes.append(as_recipe_finding(trainer["recipe"], as_run, train.get(res)))
    for name, runs in trainer.get("as_recipe_variants", {}).items():
        for res, run in runs.items():
            notes.append(variant_finding(trainer["recipe"], name, run, trainer["as_recipe"].get(res)))
    if twin := trainer.get("host_twin"):
        notes.append(host_twin_finding(twin))
    return notes


def variant_finding(recipe: str, name: str, run: dict[str, Any], as_run: dict[str, Any] | None) -> str:
    """A trainer.as_recipe_variants entry against the recipe as run at the same resolution."""
    line = (
        f"{recipe} as run with {name} ({', '.join(run['overrides'])}) at {run['resolution']} px "
        f"({_ran(run)}): {_rate(run)}{_busy(run)}{_host(run)}"
    )
    if as_run:
        line += f"; {_gain(run, as_run):.2f}x the recipe as run"
    return line


def _gain(run: dict[str, Any], as_run: dict[str, Any]) -> float:
    return run["images_per_s_per_device"] / as_run["images_per_s_per_device"]


def _layout(as_run: dict[str, Any]) -> str:
    if not as_run["channels_last"]:
        return "NCHW"
    if as_run["conv_weights_channels_last"]:
        return "NHWC"
    return "NHWC, conv kernels NCHW: each convolution copies its kernel"


def _wrapped(as_run: dict[str, Any]) -> str:
    fsdp = f"FSDP {as_run['fsdp_sharding_strategy']} per block" if as_run["fsdp"] else "no FSDP"
    return f"{fsdp}, {_layout(as_run)}"


def _ran(run: dict[str, Any]) -> str:
    return f"{_wrapped(run)}, microbatch {run['batch_size']}, {'compiled' if run['compiled'] else 'eager'}"


def _busy(run: dict[str, Any]) -> str:
    """How busy its profile found the device ("" where it was not profiled on a GPU)."""
    busy = run.get("profile", {}).get("device_busy_share")
    return f"; device busy {busy:.0%} of its bare step" if busy else ""


def _host(run: dict[str, Any]) -> str:
    """The host's work: its bare step's ATen ops and Python calls, and a whole Composer batch's."""
    profile = run.get("profile", {})
    if "python_calls_per_step" not in profile:
        return ""
    line = (
        f"; host: {profile['top_level_aten_ops_per_step']:,.0f} ATen ops and "
        f"{profile['python_calls_per_step']:,.0f} Python calls a bare step"
    )
    if batch := profile.get("composer_batch"):
        ops, calls = batch["aten_ops_per_batch"], batch["python_calls_per_batch"]
        line += f", {ops:,.0f} and {calls:,.0f} a Composer batch"
    return line


def _rate(as_run: dict[str, Any]) -> str:
    mfu = "" if as_run["mfu"] is None else f", {as_run['mfu']:.1%} MFU"
    return f"{as_run['images_per_s_per_device']:,.1f} img/s{mfu}"


def as_recipe_finding(recipe: str, as_run: dict[str, Any], step: dict[str, Any] | None) -> str:
    line = (
        f"{recipe} as a run of it trains at {as_run['resolution']} px ({_ran(as_run)}; one device, no "
        f"communication): {_rate(as_run)}, first batch {as_run['first_batch_s']:.1f} s{_busy(as_run)}"
        f"{_host(as_run)}"
    )
    if step:
        share = as_run["images_per_s_per_device"] / step["images_per_s_per_device"]
        line += f"; {share:.2f}x the step section's {step['images_per_s_per_device']:,.1f} img/s at batch "
        line += f"{step['batch_size']}"
        if share < AS_RECIPE_SHARE:
            line += " - a run of this recipe does not get the step section's MFU: its batch per GPU, FSDP"
            line += " and layout cost the difference (measure more images per GPU, fewer GPUs)"
    return line


def trainer_rows(trainer: dict[str, Any], train: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            f"Composer batch ({trainer['resolution']} px)",
            _ms(trainer["wall_per_batch_s"]),
            f"its step work {_ms(trainer['in_step_s'])}; bare step {_ms(trainer['bare_step_s'])}",
        ]
    ]
    if flow := trainer.get("flow"):
        rows.append(
            [
                "Composer batch, unsynced",
                _ms(flow["composer_per_batch_s"]),
                f"bare steps back to back {_ms(flow['bare_per_step_s'])}",
            ]
        )
    for res, as_run in trainer.get("as_recipe", {}).items():
        step = train.get(res)
        against = "-"
        if step:
            rate = step["images_per_s_per_device"]
            against = f"step section {rate:,.1f} img/s at batch {step['batch_size']}"
        batch = as_run["batch_size"]
        rows.append(
            [
                f"{trainer['recipe']} as run, {res} px ({_wrapped(as_run)}, microbatch {batch})",
                _rate(as_run),
                against,
            ]
        )
    for name, runs in trainer.get("as_recipe_variants", {}).items():
        for res, run in runs.items():
            base = trainer["as_recipe"].get(res)
            rows.append(
                [
                    f"{trainer['recipe']} as run with {name}, {res} px ({_wrapped(run)}, microbatch "
                    f"{run['batch_size']})",
                    _rate(run),
                    f"{_gain(run, base):.2f}x the recipe as run" if base else "-",
                ]
            )
    if twin := trainer.get("host_twin"):
        rows.append(host_twin_row(twin))
    return rows


def host_twin_finding(twin: dict[str, Any]) -> str:
    wrapped, bare, added = twin["runs"][WRAPPED], twin["runs"][BARE], twin["fsdp_added"]
    per = added["per_parameter_tensor"]
    mode = "compiled" if wrapped["compiled"] else "eager"
    return (
        f"host twin ({twin['recipe']} as run at SD2-base's module tree, {twin['preset']}: "
        f"{twin['parameter_tensors']} parameter tensors, {twin['fsdp_units']} FSDP units; "
        f"{twin['resolution']} px, microbatch {twin['batch_size']}, {mode}): FSDP per block "
        f"{wrapped['aten_ops_per_step']:,.0f} ATen ops and "
        f"{wrapped['python_calls_per_step']:,.0f} Python calls a step against "
        f"{bare['aten_ops_per_step']:,.0f} and {bare['python_calls_per_step']:,.0f} without "
        f"(+{per['aten_ops_per_step']:.1f} and +{per['python_calls_per_step']:.0f} per parameter tensor); "
        f"a batch {wrapped['per_batch_s']:.3f} s against {bare['per_batch_s']:.3f} s: FSDP's bookkeeping is "
        f"{added['share_of_batch']:.0%} of the batch on this host"
        + "".join(
            f"; a whole Composer batch {name} {c['aten_ops_per_batch']:,.0f} ATen ops and "
            f"{c['python_calls_per_batch']:,.0f} Python calls"
            for name, run in twin["runs"].items()
            if (c := run.get("composer_batch"))
        )
    )


def host_twin_row(twin: dict[str, Any]) -> list[str]:
    wrapped, bare = twin["runs"][WRAPPED], twin["runs"][BARE]
    return [
        f"host twin {twin['recipe']}, {twin['preset']} {twin['resolution']} px (FSDP per block / none)",
        f"{wrapped['per_batch_s'] * 1000:,.1f} / {bare['per_batch_s'] * 1000:,.1f} ms",
        f"ATen ops {wrapped['aten_ops_per_step']:,.0f} / {bare['aten_ops_per_step']:,.0f}, Python calls "
        f"{wrapped['python_calls_per_step']:,.0f} / {bare['python_calls_per_step']:,.0f} a step",
    ]
