"""The "auto" choice (cct.runtime.choice.FasterOf): measured turns, the
fastest median kept, and a choice checked again after every `recheck` runs
of it, so a choice a busy start got wrong does not last the whole run."""
from cct.runtime.choice import RECHECK_MARGIN, FasterOf


def drive(choice, cost, count):
    """`count` runs, each taking cost(candidate, run number); the candidates run in order."""
    ran = []
    for number in range(count):
        candidate = choice.next()
        ran.append(candidate)
        choice.record(candidate, cost(candidate, number))
    return ran


def test_the_fastest_median_is_chosen_after_a_warm_up_and_three_runs_each():
    """Candidates within CLEARLY_SLOWER of each other: each runs a warm-up and
    three counted runs."""
    choice = FasterOf(("a", "b", "c"), "test")
    ran = drive(choice, lambda name, _: {"a": 1.1, "b": 1.0, "c": 1.2}[name], 13)
    assert ran[:3] == ["a", "b", "c"]                        # each warmed up first, not counted
    assert choice.chosen == "b" and ran[-1] == "b"
    assert ran[:12].count("a") == ran[:12].count("c") == 4


def test_a_clearly_slower_candidate_is_measured_no_further(monkeypatch):
    """After one counted run each, c (1.3x a's) is dropped from the measuring;
    a and b go on to three runs each. With the margin out of reach (the
    control) c runs its three too."""
    import cct.runtime.choice as choice_module
    costs = {"a": 1.0, "b": 1.1, "c": 1.3}
    assert costs["c"] > choice_module.CLEARLY_SLOWER * costs["a"] > costs["b"]
    choice = FasterOf(("a", "b", "c"), "test")
    ran = drive(choice, lambda name, _: costs[name], 10)
    assert choice.chosen == "a" and ran.count("c") == 2      # a warm-up and one counted run
    assert ran[:10].count("a") == ran[:10].count("b") == 4
    monkeypatch.setattr(choice_module, "CLEARLY_SLOWER", float("inf"))
    control = FasterOf(("a", "b", "c"), "test")
    ran = drive(control, lambda name, _: costs[name], 12)
    assert control.chosen == "a" and ran.count("c") == 4


def test_a_choice_a_busy_start_got_wrong_is_measured_again_and_fixed():
    """b is the faster, but the host was busy while b was measured: a is
    chosen; the check after `recheck` runs of a sees b faster and measures
    again, and b is kept from then on."""
    choice = FasterOf(("a", "b"), "test", recheck=10)

    def cost(name, number):
        busy = number < 8
        return {"a": 2.0, "b": 1.0 if not busy else 5.0}[name]
    ran = drive(choice, cost, 60)
    first_choice_at = 8                                       # 2 warm-ups and 3 runs each
    assert ran[first_choice_at] == "a"
    assert choice.chosen == "b"
    assert ran[-20:].count("b") >= 18                         # a runs once after every 10 of b
    assert ran.count("b") >= 35
    never = FasterOf(("a", "b"), "test", recheck=10**9)       # the control: no check, a for good
    drive(never, cost, 60)
    assert never.chosen == "a"


def test_a_right_choice_costs_one_run_of_each_other_candidate_per_check():
    choice = FasterOf(("a", "b", "c"), "test", recheck=50)
    ran = drive(choice, lambda name, _: {"a": 1.0, "b": 2.0, "c": 3.0}[name], 12 + 5 * 52)
    assert choice.chosen == "a"
    checks = ran[12:]
    assert checks.count("b") == checks.count("c") == 5        # after every 50 runs of a
    assert 1.0 / RECHECK_MARGIN < 2.0                          # b and c are outside the margin


def test_the_check_is_the_same_on_every_rank_given_the_same_times():
    """Under MPI each rank records the ranks' slowest times: the same
    records make the same runs."""
    def one_rank():
        choice = FasterOf(("sequential", "streams", "tuned"), "test", recheck=7)
        return drive(choice, lambda name, number: {"sequential": 1.0, "streams": 1.05, "tuned": 0.8 + 0.01 * (number % 3)}[name], 80)
    assert one_rank() == one_rank()
