"""The plain-text tables that the benchmark drivers (bench/ddp.py, bench/train.py) print."""


def print_header(hdr):
    """A table's header line after a blank line, with a rule of its width under it."""
    print()
    print(hdr)
    print("-" * len(hdr))
