"""The reliability battery (stress tests, apart from the unit tests): its figures are written
to bench/results and summed up at the end of the session."""


def pytest_sessionfinish(session, exitstatus):
    import battery

    path = battery.write_figures()
    if path is not None:
        session.config._battery_results = path


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import battery

    if not battery.FIGURES:
        return
    terminalreporter.section("reliability figures")
    for line in battery.summary_lines():
        terminalreporter.write_line(line)
    if path := getattr(config, "_battery_results", None):
        terminalreporter.write_line(f"written to {path}")
