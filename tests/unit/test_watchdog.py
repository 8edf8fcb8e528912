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
