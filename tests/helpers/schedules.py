"""Schedules for tests of the streams' dependencies."""


def loose(schedule):
    """Every sub-task on one core of three: as many at once as there are
    streams, whatever the edges allow (the widths of a real run, a layer on
    every thread, would let fewer interleave)."""
    schedule.cores = 3
    schedule.widths = {task: (1, None) for task in schedule.tasks}
    return schedule
