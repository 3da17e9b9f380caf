"""One rank of ``remat distributed`` on several nodes: ``torchrun ... -m remat.cli.distributed_rank --config
run.json --out DIR`` (the command ``remat distributed --emit-config`` prints, NOTE [launcher] in
remat.distributed.launch).

It runs the same rank program as a local run (remat.distributed.worker), then does what the
local command does once the ranks are done: each node's local rank 0 prints the table from the
report every rank received (NOTE [rank report]), and every rank exits with the verdict, 1 when
the plan is not the control's step or a rank is over the budget (NOTE [teardown]).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

from ..distributed import DistributedConfig, DistributedReport
from ..distributed.worker import REPORT_NAME, RankFiles, run_rank
from ..distributed.worker import main as worker_main


def _run_and_render(cfg: DistributedConfig, out: Path, files: RankFiles) -> int:
    code = run_rank(cfg, out, files)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        from .._json import read_json_file
        from ..errors import DistributedError
        from .cmd_distributed import render_report
        from .render import console
        report = DistributedReport.from_json(read_json_file(out / REPORT_NAME, error=DistributedError,
                                                            what="distributed report"))
        render_report(report)
        verdict = "[green]passed[/]" if report.passed else "[bold red]FAILED[/] (every rank exits 1)"
        console.print(f"node of rank {files.rank}: wrote {out / REPORT_NAME}; {verdict}")
    return code


def main(argv: list[str] | None = None) -> NoReturn:
    worker_main(argv, prog="python -m remat.cli.distributed_rank", run=_run_and_render)


if __name__ == "__main__":
    main()
