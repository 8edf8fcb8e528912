"""``benchmarks/plan_refit.py``: which CSV rows count as measured (pruned, failed and zero rows
do not; a layout measured twice stays two rows) and its error arithmetic."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from plan_refit import DATA, GRIDS, SKIPPED, Row, check_table, measured_rows, summary  # noqa: E402

CSV = """workload,gpus,planner_rank,layout,predicted,measured,error_pct,estimate_gib,peak_gib,note,flags
deepseek,2,1,tp1 pp1 dp2 ep2 mbs2 dist-opt,100,80,,1,1,,
deepseek,2,2,tp1 pp1 dp2 mbs1 fsdp,100,0,,1,0.0,"failed: out of memory",
deepseek,2,3,tp1 pp2 dp1 mbs8 -,100,,,1,,not run: budget spent,
deepseek,2,pruned,tp1 pp1 dp2 mbs8 dist-opt,100,90,,1,1,pruned for memory,
deepseek,2,recheck,tp1 pp1 dp2 ep2 mbs2 dist-opt,,125,,1,1,,
"""


def test_only_measured_rows_count_and_repeats_stay_separate(tmp_path):
    path = tmp_path / "plan_check.csv"
    path.write_text(CSV)
    rows = measured_rows(path)
    assert [(r.layout, r.measured) for r in rows] == [("tp1 pp1 dp2 ep2 mbs2 dist-opt", 80.0), ("tp1 pp1 dp2 ep2 mbs2 dist-opt", 125.0)]


def test_errors_are_prediction_over_measurement():
    rows = [Row("a", 80.0, 100.0), Row("a", 125.0, 100.0), Row("b", 100.0, 110.0)]
    assert [round(r.error, 3) for r in rows] == [0.25, -0.2, 0.1]
    assert summary(rows) == "mean |error| 18.3 %, max 25.0 %, 2 of 3 outside 15 %"


def test_every_data_csv_is_predicted_or_skipped_with_its_calibration_present():
    check_table()
    for name, calibration, _, _ in GRIDS:
        assert (DATA / name).is_file() and (DATA / calibration).is_file() and name not in SKIPPED
