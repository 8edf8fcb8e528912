"""The watchdog's limit: the set timeout, or a multiple of the recent steps' median once there are enough
(the hang report itself is drilled in tests/e2e/test_hang.py)."""

from meshtron.training.watchdog import MIN_STEPS, Watchdog


def test_step_limit_follows_the_recent_median_only_for_steps_and_after_warm_up():
    dog = Watchdog(limit_s=600, step_factor=10, rank=0, world_size=1, say=print)
    assert dog.allowed() == (600, "--train-timeout-minutes 10")
    dog.enter("step", 0)
    for i in range(MIN_STEPS):
        dog.since -= 2.0  # a step of 2 s
        dog.enter("step", i + 1)
    limit, why = dog.allowed()
    assert abs(limit - 20.0) < 0.01 and why == "--hang-step-factor 10 x the median step of 2.00s"
    dog.enter("save", MIN_STEPS)  # a save may take longer than a step: only the set limit holds
    assert dog.allowed()[0] == 600
    dog.enter("step", MIN_STEPS)
    assert len(dog.steps) == MIN_STEPS  # the time of the save is not a step's
    assert Watchdog(limit_s=10, step_factor=10, rank=0, world_size=1, say=print).allowed()[0] == 10


def test_flight_recorder_is_on_unless_the_environment_says_and_names_what_waits(monkeypatch):
    from meshtron.training import flight_recorder

    for name in flight_recorder.SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    flight_recorder.enable()
    assert flight_recorder.os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the older name, set to off: left off
    flight_recorder.enable()
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder.os.environ
    assert flight_recorder.dump(0) == ["flight recorder off: set TORCH_FR_BUFFER_SIZE=2000 for each rank's last collectives"]
    entry = {"pg_id": 1, "process_group": ("1", "dp"), "is_p2p": False, "profiling_name": "nccl:all_reduce", "input_sizes": [[4]]}
    trace = {"pg_status": {"0": {"last_enqueued_collective": 3, "last_completed_collective": 3},
                           "1": {"last_enqueued_collective": 8, "last_completed_collective": 6}},
             "entries": [{**entry, "collective_seq_id": n, "state": s} for n, s in ((6, "completed"), (7, "started"), (8, "scheduled"))]}  # fmt: skip
    assert flight_recorder.pending(trace) == ["flight recorder: process group 1 (dp) completed #6, waits in "
                                              "#7 nccl:all_reduce [[4]] (started), #8 nccl:all_reduce [[4]] (scheduled)"]  # fmt: skip
