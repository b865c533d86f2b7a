"""The A/B memory runner from Python: tally.ab.run(...) runs Tally's `ab_memory` program
(examples/ab_memory.cpp: every configuration of checkpointing x precision x the memory
levers, with the same seed and data) and returns a Report, which Jupyter displays inline
(report.html in an iframe); tally.ab.load(folder) reads a finished run.

    report = tally.ab.run(model="resnet", arch="tiny", steps=3,
                          checkpoint=["none", "blocks"], amp=["off", "bf16"])
    report            # in a notebook: the HTML report
    report.results    # results.json: one dict per configuration (bytes, ms, loss)
"""

import html
import json
import os
import shutil
import subprocess
import tempfile

from . import _C

__all__ = ["Report", "run", "load", "program"]


def _installed_bin():
    """P/bin of the prefix this package was installed into (cmake --install --prefix P);
    None in the build tree, which has no _prefix.py."""
    try:
        from . import _prefix
    except ImportError:
        return None
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), _prefix.BIN))


def _tool(name, env):
    """A program of Tally's: $env; next to the package (pip install puts it there); P/bin of
    the prefix P that `cmake --install` put the package under (P/lib/python3.X/site-packages/
    tally); the build tree this module was built in; PATH."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get(env), os.path.join(here, name),
                  os.path.normpath(os.path.join(here, "..", "..", "..", "..", "bin", name))]
    installed = _installed_bin()
    if installed:
        candidates.append(os.path.join(installed, name))
    if name == "ab_memory":
        candidates.append(_C._ab_memory_path)
    candidates.append(shutil.which(name))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        f"{name} not found next to the package, in the install prefix's bin/, in the build tree "
        f"or on PATH: build it (cmake --build build --target {name}), or set {env}")


def program():
    """The ab_memory executable ($TALLY_AB_MEMORY, next to the package, P/bin, the build
    tree's, or one on PATH)."""
    return _tool("ab_memory", "TALLY_AB_MEMORY")


def _mib(b):
    return "—" if b is None else f"{b / 2**20:,.1f} MiB"


class Report:
    """One A/B run: `results` (results.json's rows), `table` (the program's text table),
    `folder`, `report_path`; displays as the HTML report in Jupyter."""

    def __init__(self, folder, stdout=""):
        self.folder = os.path.abspath(folder)
        self.stdout = stdout
        with open(os.path.join(self.folder, "results.json"), encoding="utf-8") as f:
            self.results = json.load(f)
        self.report_path = os.path.join(self.folder, "report.html")

    @property
    def names(self):
        return [r["name"] for r in self.results]

    def __getitem__(self, name):
        for r in self.results:
            if r["name"] == name:
                return r
        raise KeyError(f"no configuration {name!r} (have {self.names})")

    def summary(self):
        """One line per configuration against the first: peak and step time."""
        base = self.results[0]
        lines = []
        for r in self.results:
            line = f"{r['name']:<32} peak {_mib(r['peak_allocated'])}"
            if r is not base and base["peak_allocated"]:
                change = r["peak_allocated"] / base["peak_allocated"] - 1
                line += f" ({change:+.0%})"
            if r.get("median_ms") is not None:
                line += f", step {r['median_ms']:.1f} ms"
                if r is not base and base.get("median_ms"):
                    line += f" ({r['median_ms'] / base['median_ms'] - 1:+.0%})"
            lines.append(line)
        return "\n".join(lines)

    def __repr__(self):
        return f"Report({self.folder!r})\n" + self.summary()

    def html(self):
        with open(self.report_path, encoding="utf-8") as f:
            return f.read()

    def _link_base(self):
        """The report folder relative to the kernel's working directory (the notebook's
        folder), or None when the folder is outside it."""
        rel = os.path.relpath(self.folder, os.getcwd())
        if rel == os.curdir:
            return ""
        if rel.startswith(os.pardir) or os.path.isabs(rel):
            return None
        return rel.replace(os.sep, "/") + "/"

    def _repr_html_(self):
        # The report is a whole page with its own script: an iframe keeps it apart from the
        # notebook's page and styles. A srcdoc page resolves relative links against the
        # notebook's own address, so a <base> pointing at the report folder (relative to the
        # notebook's folder, which the Jupyter server serves) makes the links to snapshots
        # and timelines work; they open in a new tab. A folder outside the notebook's folder
        # (the temporary one run() makes by default) cannot be served: a note says where the
        # files are.
        page = self.html()
        base = self._link_base()
        note = ""
        if base is not None:
            tag = f'<base href="{html.escape(base, quote=True)}" target="_blank">'
            page = page.replace("<head>", "<head>" + tag, 1) if "<head>" in page else tag + page
        else:
            note = ('<p style="font:13px sans-serif">The links to snapshots and timelines '
                    f'open from the notebook\'s folder; this run\'s files are in '
                    f'<code>{html.escape(self.folder)}</code> (pass <code>out=</code> a folder '
                    'under the notebook\'s to follow them from here).</p>')
        page = html.escape(page, quote=True)
        return (f'<iframe srcdoc="{page}" style="width:100%;height:900px;border:0" '
                f'sandbox="allow-scripts allow-popups allow-popups-to-escape-sandbox">'
                f'</iframe>{note}')


def load(folder):
    """The Report of a finished ab_memory run in `folder`."""
    return Report(folder)


def _comma(v):
    if v is None:
        return None
    return v if isinstance(v, str) else ",".join(str(x) for x in v)


def run(model="resnet", out=None, *, arch=None, preset=None, steps=3, batch=None,
        checkpoint=("none", "blocks"), amp=("off", "bf16"), device=None, optimizer=None,
        offload=None, estimate=None, seed=None, extra_args=(), timeout=None):
    """Runs ab_memory and returns its Report. `checkpoint`, `amp`, `optimizer`, `offload`:
    lists (or comma strings) of the configurations to compare; `out`: the output folder
    (default: a new temporary folder; give a folder under the notebook's for the report's
    links to open from the notebook). Raises RuntimeError with the program's output when
    it fails."""
    if out is None:
        out = tempfile.mkdtemp(prefix="tally_ab_")
    args = [program(), "--model", model, "--out", str(out)]
    for flag, value in (("--arch", arch), ("--preset", preset), ("--steps", steps),
                        ("--batch", batch), ("--checkpoint", _comma(checkpoint)),
                        ("--amp", _comma(amp)), ("--device", device),
                        ("--optimizer", _comma(optimizer)), ("--offload", _comma(offload)),
                        ("--estimate", estimate), ("--seed", seed)):
        if value is not None:
            args += [flag, str(value)]
    args += [str(a) for a in extra_args]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ab_memory exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return Report(out, proc.stdout)
