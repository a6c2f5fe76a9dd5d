"""Testing tools for tilefuse users: bitwise comparators, error metrics, input generators, timers."""

__all__: list[str] = []
