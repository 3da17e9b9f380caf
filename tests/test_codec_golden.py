"""The receipt's codec, held to golden files made before the codecs moved to the types (NOTE [codecs
from the types] in remat/_codec.py).

tests/golden/receipt.json is a receipt of tests/test_receipt.py's tiny MLP at test sizes with a run at
world size 2 (tests/golden/make_golden.py made both files, on the code before the change). Ground
truth: (1) reading the file and writing it again gives its bytes; (2) each hostile edit (wrong type,
out-of-bound number, extra key, missing key, in every part of the receipt) is refused with the error
class it was refused with then (tests/golden/hostile.json), and an accepted edit stays accepted.
The wrong case: a byte changed in a figure must not round-trip to the golden bytes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from remat.errors import DistributedError, ReceiptError, RematError
from remat.receipt import Receipt
from remat.receipt.write import receipt_bytes

GOLDEN = Path(__file__).resolve().parent / "golden"

Edit = Callable[[dict], None]


def _set(path: str, value: Any) -> Edit:
    """Set the key at ``path`` ("a.b.0.c") to ``value``."""
    def edit(d: dict) -> None:
        *head, last = path.split(".")
        node = _at(d, head)
        node[int(last) if isinstance(node, list) else last] = value
    return edit


def _drop(path: str) -> Edit:
    def edit(d: dict) -> None:
        *head, last = path.split(".")
        del _at(d, head)[last]
    return edit


def _at(d: Any, keys: list[str]) -> Any:
    for k in keys:
        d = d[int(k)] if isinstance(d, list) else d[k]
    return d


# One object per migrated type: a wrong type, an out-of-bound number, an extra key, a missing key.
_PARTS: dict[str, tuple[str, str, Any, str]] = {
    # part: (its path, an int or str field, an out-of-bound value for a number field "name=value", a required key)
    "context": ("context", "threads", "threads=-1", "hostname"),
    "settings": ("settings", "trace_steps", "trace_steps=100000", "note"),
    "fixture": ("plan.boundaries.0.fixture", "steps", "steps=0", "dtype"),
    "boundary": ("plan.boundaries.0", "replay_ms", "saving_tolerance=1.5", "revision"),
    "traces": ("traces", "target", "", "planned"),
    "plan": ("plan", "note", "control_held_bytes=-1", "closed_loop"),
    "rejected": ("decision.rejected.0", "reason", "peak_bytes=-5", "plan"),
    "decision": ("decision", "budget_bytes", "reserve=1.0", "why"),
    "unsupported": ("unsupported.0", "detail", "", "status"),
    "world_size": ("world_size", "check_steps", "check_timeout_s=0.5", "report"),
    "world_size.report": ("world_size.report", "budget_bytes", "world_size=0", "engine"),
    "world_size.report.rank": ("world_size.report.per_rank.plan.0", "peak_bytes", "", "p50_ms"),
    "world_size.report.equivalence": ("world_size.report.equivalence", "params_compared", "", "criterion"),
}


def _edits() -> dict[str, Edit]:
    out: dict[str, Edit] = {}
    for part, (path, field, bound, required) in _PARTS.items():
        out[f"{part}: wrong type"] = _set(f"{path}.{field}", [1])
        if bound:
            name, value = bound.split("=")
            out[f"{part}: out of bound"] = _set(f"{path}.{name}", json.loads(value))
        out[f"{part}: extra key"] = _set(f"{path}.zz_extra", 1)
        out[f"{part}: missing key"] = _drop(f"{path}.{required}")
    out["status: not a status"] = _set("decision.status", "maybe")
    out["rejected: not a decision"] = _set("decision.rejected.0.decision", "ship")
    out["boundary: keep is no mode"] = _set("plan.boundaries.0.mode", "keep")
    out["context: memory source"] = _set("context.memory_source", "abacus")
    out["settings: compile given"] = _set("settings.compile", {"mode": 1})
    out["excluded: not text"] = _set("plan.excluded_after_verify", {"h.1": 3})
    out["fixture: no seeds"] = _set("plan.boundaries.0.fixture.seeds", [])
    return out


EDITS = _edits()


def outcome(text: bytes, edit: Edit) -> str:
    """The error class reading ``text`` edited by ``edit`` raises, or "accepted"."""
    d = json.loads(text)
    edit(d)
    try:
        Receipt.from_json(d)
    except RematError as exc:
        return type(exc).__name__
    return "accepted"


def describe(spec: Any) -> Any:
    """A Spec as JSON: its class and every attribute (nested Specs described the same way)."""
    from remat._json import Spec
    if isinstance(spec, Spec):
        return {"spec": type(spec).__name__, **{k: describe(v) for k, v in sorted(vars(spec).items())}}
    if isinstance(spec, dict):
        return {str(k): describe(v) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return [describe(x) for x in spec]
    return repr(spec)


def describe_schemas() -> dict[str, Any]:
    from remat.distributed.config import CONFIG_SCHEMA
    from remat.receipt import RECEIPT_SCHEMA
    return {"receipt": describe(RECEIPT_SCHEMA), "distributed config": describe(CONFIG_SCHEMA)}


def test_the_derived_schemas_are_the_hand_ones():
    """Every key, its spec's class and bounds, as the hand schemas (tests/golden/schemas.json) had them. Since
    NOTE [one receipt] the single-process sections are optional keys of the schema, each with the spec it had
    (a single-process file must still hold them all: Receipt.from_json), and ``world_size``'s spec is derived
    from WorldSizeEvidence (it was checked by hand after the schema)."""
    want = json.loads((GOLDEN / "schemas.json").read_text())
    got = json.loads(json.dumps(describe_schemas()))
    assert got == want
    got["receipt"]["optional"]["settings"]["required"]["trace_steps"]["hi"] = "1001"   # the wrong case
    assert got != want


@pytest.fixture(scope="module")
def golden() -> bytes:
    return (GOLDEN / "receipt.json").read_bytes()


def test_the_golden_receipt_reads_and_writes_its_own_bytes(golden):
    receipt = Receipt.loads(golden)
    assert receipt.world_size is not None and receipt.plan.boundaries   # every part is there to check
    assert receipt_bytes(receipt) == golden


def test_the_golden_receipt_with_its_optional_keys_reads_and_writes_its_own_bytes():
    text = (GOLDEN / "receipt_optional.json").read_bytes()
    receipt = Receipt.loads(text)
    assert receipt.context.autocast == "bfloat16" and receipt.plan.excluded_after_verify
    assert receipt_bytes(receipt) == text


def test_the_golden_distributed_config_reads_and_writes_its_own_bytes(tmp_path):
    """A pipeline config (distributed/config.py, PipelineSettings from its fields) read and saved again."""
    from remat.distributed.config import DistributedConfig
    text = (GOLDEN / "distributed_config.json").read_bytes()
    config = DistributedConfig.from_json(json.loads(text))
    assert config.pipeline is not None and config.pipeline.sides[-1].value == "remat"
    assert config.save(tmp_path / "config.json").read_bytes() == text
    edited = json.loads(text)
    edited["pipeline"]["microbatches"] = 0   # the wrong case: out of bound, refused as before
    with pytest.raises(DistributedError, match="microbatches"):
        DistributedConfig.from_json(edited)
    edited = json.loads(text)
    del edited["pipeline"]["reserve"]        # every settings key is required
    with pytest.raises(DistributedError, match="reserve"):
        DistributedConfig.from_json(edited)


_STAGE_KEYS = ("stage", "host", "in_flight", "blocks", "boundaries", "forward_ms", "backward_ms", "replay_ms",
               "optimizer_ms", "idle_ms", "bubble_fraction", "held_at_backward_bytes", "bubble_delta_vs_none",
               "predicted_peak_bytes", "grad_sq_sum", "timeline")


def _one_report(old: dict) -> dict:
    """An old-layout pipeline report's figures placed, by hand, as the one per-rank report holds them (NOTE [one
    per-rank report] in remat/distributed/report.py): a stage row is a rank's row (its p2p the row's communication)
    with its ``stage``; each side's figures laid side by side; the pipeline's own figures under ``pipeline``."""
    from remat.distributed.pipeline.report import COMM_SOURCE
    sides = old["sides"]

    def row(s: dict) -> dict:
        return {"rank": s["rank"], "peak_bytes": s["peak_bytes"], "p50_ms": s["p50_ms"], "p95_ms": s["p95_ms"],
                "exposed_comm_ms": s["exposed_p2p_ms"], "comm_ms": s["p2p_ms"], "ablation_step_ms": None,
                "step_ms": [], "stage": {k: s[k] for k in _STAGE_KEYS}}

    def by(get) -> dict:
        return {name: get(side) for name, side in sides.items()}

    plans = old["plans"]
    planned = [b["module"] for st in plans["remat"]["stages"] for b in st["plan"]["boundaries"]] \
        if "remat" in plans else []
    over = [s["rank"] for s in sides.get("remat", {}).get("per_stage", [])
            if old["budget_bytes"] is not None and s["peak_bytes"] > old["budget_bytes"]]
    return {"schema_version": 1, "world_size": old["world_size"], "engine": "pipeline", "backend": old["backend"],
            "device": old["device"], "dtype": old["dtype"], "workload": {"spec": old["spec"], "shape": old["shape"]},
            "torch_version": old["torch_version"], "steps": old["steps"], "warmup": old["warmup"], "comm_steps": 0,
            "samples_per_step": [old["batch_size"]] * old["world_size"], "memory_source": old["memory_source"],
            "comm_source": COMM_SOURCE, "plan_boundaries": planned,
            "per_rank": by(lambda side: [row(s) for s in side["per_stage"]]),
            "global_samples_per_s": by(lambda side: side["samples_per_s"]),
            "step_ms_p50": by(lambda side: side["p50_ms"]), "collectives": by(lambda side: {}),
            "exposed_comm_ms": by(lambda side: max(s["exposed_p2p_ms"] for s in side["per_stage"])),
            "comm_ms": by(lambda side: max(s["p2p_ms"] for s in side["per_stage"])),
            "ablation_step_ms": by(lambda side: None), "equivalence": None, "budget_bytes": old["budget_bytes"],
            "over_budget_ranks": over,
            "passed": all(e["ok"] for e in old["equivalence"].values()) and old["negative_control_rejected"] is not False
            and not over,
            "notes": old["notes"],
            "pipeline": {k: old[k] for k in ("schedule", "microbatches", "batch_size", "split_points", "split_source",
                                             "stages_per_rank", "ideal_bubble_fraction", "timeout_s")}
            | {"step_ms_p95": by(lambda side: side["p95_ms"])}
            | {k: old[k] for k in ("equivalence", "negative_control_rejected", "plans")}}


def _one_receipt(old: dict, report: dict | None = None) -> dict:
    """The old-format pipeline receipt's parts, placed as the one receipt holds them (NOTE [one receipt] in
    remat/receipt/model.py), by hand: the figures must be the same, byte for byte. ``report``: its pipeline report
    (default: the old one's figures in the one per-rank report, :func:`_one_report`)."""
    return {"schema_version": 1, "kind": "remat-receipt", "context": old["context"],
            "world_size": {"engine": "pipeline", "world_size": old["pipeline"]["world_size"],
                           "pipeline": {"report": _one_report(old["pipeline"]) if report is None else report,
                                        "boundaries": old["boundaries"]},
                           "check_steps": old["check_steps"], "check_timeout_s": old["check_timeout_s"]}}


def test_a_pipeline_run_is_one_receipt_holding_the_old_golden_figures():
    """tests/golden/pipeline_receipt.json (the old format, made before the one receipt) moved by hand into the
    one receipt's places, its report into the one per-rank report's, reads and writes its own bytes; the wrong
    cases: an out-of-bound figure, a single-process section beside a pipeline run, and a pipeline run's world size
    that is not its report's."""
    from remat.receipt.world_size import PipelineEvidence
    old = json.loads((GOLDEN / "pipeline_receipt.json").read_bytes())
    text = (json.dumps(_one_receipt(old), indent=1, allow_nan=False) + "\n").encode("utf-8")
    receipt = Receipt.loads(text)
    assert isinstance(receipt.pipeline, PipelineEvidence) and receipt.settings is None and receipt.decision is None
    assert receipt.pipeline.report.spec == receipt.context.workload == "gpt"
    assert receipt_bytes(receipt) == text
    report = receipt.pipeline.report
    none = report.side("none")
    assert none is not None and none.step_ms_p95 == old["pipeline"]["sides"]["none"]["p95_ms"]
    assert none.max_bubble_fraction == old["pipeline"]["sides"]["none"]["max_bubble_fraction"]
    assert none.max_peak_bytes == old["pipeline"]["sides"]["none"]["max_peak_bytes"]
    edited = json.loads(text)
    edited["world_size"]["check_steps"] = 0   # out of bound, refused as before
    with pytest.raises(ReceiptError, match="check_steps"):
        Receipt.from_json(edited)
    edited = json.loads(text)
    edited["world_size"]["pipeline"]["report"]["per_rank"]["none"][0]["stage"]["bubble_fraction"] = 1.5
    with pytest.raises(ReceiptError, match="bubble_fraction"):   # the report's bounds, as pipeline.json's were
        Receipt.from_json(edited)
    edited = json.loads(text)
    edited["settings"] = json.loads((GOLDEN / "receipt.json").read_bytes())["settings"]
    with pytest.raises(ReceiptError, match="single-process"):
        Receipt.from_json(edited)
    edited = json.loads(text)
    edited["world_size"]["world_size"] = 3
    with pytest.raises(ReceiptError, match="another world size"):
        Receipt.from_json(edited)


def test_an_old_layout_pipeline_report_is_refused_with_the_command_that_makes_it_again():
    """The pipeline report of the layout before the one per-rank report: in a one receipt, StaleReceiptFormat
    (exit 2); as a pipeline.json, StaleReportFormat; each naming the command. The safe twin: the same figures in
    the one per-rank report are read."""
    from remat.distributed.report import DistributedReport
    from remat.errors import StaleReceiptFormat, StaleReportFormat
    old = json.loads((GOLDEN / "pipeline_receipt.json").read_bytes())
    command = ("`remat distributed --engine pipeline --workload gpt --world-size 2 --schedule 1f1b --microbatches 2 "
               "--split-points h.2 --out DIR`")
    with pytest.raises(StaleReceiptFormat, match="old format") as info:
        Receipt.from_json(_one_receipt(old, report=old["pipeline"]))
    assert info.value.exit_code == 2 and command in info.value.tip
    Receipt.from_json(_one_receipt(old))
    with pytest.raises(StaleReportFormat, match="old layout") as err:
        DistributedReport.from_json(old["pipeline"])
    assert err.value.exit_code == 2 and command.replace("--world-size 2", "--world-size 2 --shape n_layer=4,d_model=32,"
                                                        "n_head=2,seq_len=16,batch_size=8,vocab=64") in err.value.tip
    DistributedReport.from_json(_one_report(old["pipeline"]))


def test_a_single_process_receipt_missing_a_section_is_refused(golden):
    """The sections are optional keys of the schema (a pipeline run has none), so the reader requires them."""
    for key in ("settings", "verification", "verification_note", "unsupported"):
        d = json.loads(golden)
        del d[key]
        with pytest.raises(ReceiptError, match=f"missing field.*{key}"):
            Receipt.from_json(d)
    d = json.loads(golden)
    d["settings"] = None   # null is no section either
    with pytest.raises(ReceiptError):
        Receipt.from_json(d)
    Receipt.from_json(json.loads(golden))   # the safe twin


def test_an_old_format_pipeline_receipt_is_refused_with_the_command_that_makes_it_again():
    from remat.errors import StaleReceiptFormat
    old = json.loads((GOLDEN / "pipeline_receipt.json").read_bytes())
    with pytest.raises(StaleReceiptFormat, match="old format") as info:
        Receipt.from_json(old)
    assert info.value.exit_code == 2
    assert ("`remat distributed --engine pipeline --workload gpt --world-size 2 --schedule 1f1b --microbatches 2 "
            "--split-points h.2 --out DIR`") in info.value.tip
    Receipt.from_json(_one_receipt(old))   # the safe twin: the same figures in the one receipt are read
    old["context"]["workload"] = "gpt; rm -rf /"   # a value that is not a plain word is never put in the command
    with pytest.raises(StaleReceiptFormat) as info:
        Receipt.from_json(old)
    assert "--workload WORKLOAD " in info.value.tip and "rm -rf" not in info.value.tip


def test_a_changed_figure_is_not_the_golden_bytes(golden):
    d = json.loads(golden)
    d["decision"]["budget_bytes"] += 1
    assert receipt_bytes(Receipt.from_json(copy.deepcopy(d))) != golden


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    return json.loads((GOLDEN / "hostile.json").read_text())


def test_every_edit_has_its_golden_outcome(expected):
    assert set(expected) == set(EDITS)
    assert sum(v != "accepted" for v in expected.values()) >= len(expected) - 5   # the edits are mostly refused


# Edits the hand codecs accepted and the codecs from the types refuse, each with why (a file refused
# before is never accepted now: only "accepted" may change, and only to a refusal).
TIGHTENED = {
    # Equivalence.from_json passed its keys through unread; the codec reads params_compared through int()
    "world_size.report.equivalence: wrong type": "ReceiptError",
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_hostile_edit_meets_its_golden_outcome(golden, expected, name):
    want = TIGHTENED.get(name, expected[name])
    assert name not in TIGHTENED or expected[name] == "accepted"
    assert outcome(golden, EDITS[name]) == want


# -- the check's own JSON: what the hand codecs wrote, written out by hand -----------------------------

def test_the_check_report_is_its_fields_in_order():
    from remat.workflow.check import CheckReport
    from remat.workflow.findings import CheckFinding, FindingKind
    kind = next(iter(FindingKind))
    finding = CheckFinding(kind=kind, message="peak over budget", boundary="h.1")
    report = CheckReport(passed=False, quick=True, workload="mlp", failures=[finding], checked=["shape"],
                         skipped=["time: --quick"], wall_s=1.5)
    want = {"passed": False, "quick": True, "workload": "mlp",
            "failures": [{"kind": kind.value, "message": "peak over budget", "boundary": "h.1"}],
            "checked": ["shape"], "skipped": ["time: --quick"], "wall_s": 1.5}
    assert json.dumps(report.to_json()) == json.dumps(want)   # keys in this order, too
    assert json.dumps(report.to_json()) != json.dumps(dict(reversed(want.items())))   # the wrong case


def test_the_rerun_request_is_asdict_and_reads_back():
    import dataclasses
    from remat.workflow.check_child import RerunRequest
    req = RerunRequest(receipt="/tmp/r.json", digest="ab" * 32, quick=False, workload=None, cwd="/tmp",
                       gate={"time_tolerance": 0.25, "pins": {"torch": "2.5"}}, threads=2)
    assert json.dumps(req.to_json()) == json.dumps(dataclasses.asdict(req))   # the hand codec was asdict
    assert RerunRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
    assert RerunRequest.from_json({**req.to_json(), "threads": 3}) != req   # the wrong case


def test_remat_check_refuses_an_old_format_pipeline_receipt_with_exit_2(tmp_path, capsys):
    """Nothing is loaded or launched: the refusal comes from reading the file (the safe twin, a receipt in the one
    format, is read: the tests above)."""
    import shutil
    from remat.cli.main import main
    shutil.copy(GOLDEN / "pipeline_receipt.json", tmp_path / "receipt.json")
    assert main(["check", str(tmp_path / "receipt.json"), "--quick", "--no-reports"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "old format" in err and "remat distributed --engine pipeline --workload gpt" in err


def test_a_pipeline_run_renders_as_it_did_before_the_one_per_rank_report():
    """pipeline.md and the receipt's report.html + report.md of the old golden's figures, rendered from the one
    per-rank report, are the bytes the renderers wrote from the old PipelineReport (tests/golden/pipeline_render.md
    and pipeline_receipt_render.txt, written by that code from the same file); the wrong case: one changed figure."""
    from remat.distributed.report import DistributedReport
    from remat.receipt.render import render_html, render_markdown, render_pipeline_markdown
    old = json.loads((GOLDEN / "pipeline_receipt.json").read_bytes())
    report = DistributedReport.from_json(_one_report(old["pipeline"]))
    assert render_pipeline_markdown(report) == (GOLDEN / "pipeline_render.md").read_text()
    receipt = Receipt.from_json(_one_receipt(old))
    assert render_html(receipt) + "\n=====\n" + render_markdown(receipt) == \
        (GOLDEN / "pipeline_receipt_render.txt").read_text()
    edited = _one_report(old["pipeline"])
    edited["per_rank"]["none"][0]["stage"]["bubble_fraction"] = 0.5
    assert render_pipeline_markdown(DistributedReport.from_json(edited)) != (GOLDEN / "pipeline_render.md").read_text()
