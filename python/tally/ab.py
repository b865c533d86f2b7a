"""The A/B memory runner from Python, in process: tally.ab.run(...) trains every combination
of the memory levers (checkpointing x precision x optimizer x offload x step-in-backward x
gradient accumulation x allocator settings) on the same model, seed and data, through the
library call tally::ab::run (ab/ab.h), and returns a Report, which Jupyter displays inline
(report.html in an iframe); tally.ab.load(folder) reads a finished run.

    report = tally.ab.run(model="resnet", preset="tiny", steps=3,
                          checkpoint=["none", "blocks"], precision=["off", "bf16"])
    report = tally.ab.run(model=MyNet(), step=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                          data=[(x, y)] * 3, grad_accum=[1, 2])
    report            # in a notebook: the HTML report
    report.results    # results.json: one dict per configuration (bytes, ms, loss)
"""

import html
import json
import os
import shutil
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
    """One A/B run: `results` (results.json's rows), `headlines` (each configuration against the
    first), `table` (the text table), `folder`, `report_path`; displays as the HTML report in
    Jupyter."""

    def __init__(self, folder, stdout=""):
        self.folder = os.path.abspath(folder)
        self.stdout = stdout
        self.table = stdout
        self.headlines = []
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
        """One line per configuration against the first: peak and step time (with the timing
        rounds' range)."""
        base = self.results[0]
        lines = []
        for r in self.results:
            line = f"{r['name']:<32} peak {_mib(r['peak_allocated'])}"
            if r is not base and base["peak_allocated"]:
                change = r["peak_allocated"] / base["peak_allocated"] - 1
                line += f" ({change:+.0%})"
            if r.get("median_ms") is not None:
                line += f", step {r['median_ms']:.1f} ms"
                if len(r.get("round_ms") or []) > 1:
                    line += f" [{r['min_ms']:.1f}-{r['max_ms']:.1f} over {len(r['round_ms'])} rounds]"
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


def _list(v, kind=str):
    """A lever's values: a list or tuple, or a comma string ("none,blocks"); None stays None."""
    if v is None:
        return None
    if isinstance(v, str):
        v = [x for x in v.split(",") if x]
    elif not isinstance(v, (list, tuple)):
        v = [v]
    if kind is bool:
        out = []
        for x in v:
            if isinstance(x, str):
                if x not in ("on", "off"):
                    raise ValueError(f"step_in_backward: expected on or off, got {x!r}")
                x = x == "on"
            out.append(bool(x))
        return out
    return [kind(x) for x in v]


def run(model="resnet", step=None, data=None, *, eval=None, checkpoint=None, precision=None,
        optimizer=None, offload=None, step_in_backward=None, grad_accum=None, alloc_conf=None,
        steps=None, batch=None, seed=None, lr=None, rounds=None, device=None, estimate=None,
        out=None, title=None, preset=None, verbose=False, amp=None, arch=None,
        memory_budget=None, **model_options):
    """Runs every combination of the levers in this process and returns the Report.

    model: a registry model's name ("resnet", "gpt", ...; `preset=` and model options such as
      image_size=, seq=), a tally.nn.Module (every configuration starts from its state now, and
      it has that state again afterwards), or a factory building one (a Module subclass, a
      function of no arguments), called under the device being measured.
    step: step(model, (input, target)) -> loss; default: the registry model's loss, else
      cross_entropy(model(input), target). eval: eval(model, batch) after the last step.
    data: a list of batches ((input, target) tuples of tensors or numpy arrays), or a function
      of the step number returning one; default: the registry model's synthetic batches.
    checkpoint, precision (amp), optimizer, offload, step_in_backward, grad_accum, alloc_conf:
      lists (or comma strings) of each lever's values to compare.
    memory_budget: bytes or '40MiB': checkpoint 'auto' (and precision 'auto') rows are planned by
      tally.memory.plan's planner to fit it (checkpointing, precision, and the optimizer,
      step-in-backward and micro-batches a row leaves at their defaults).
    out: the output folder (default: a new temporary folder; give a folder under the
      notebook's for the report's links to open from the notebook). rounds: interleaved timing
      rounds (default 3). verbose: print the table and the headlines."""
    if precision is not None and amp is not None:
        raise ValueError("tally.ab.run: precision and amp name the same lever: give one")
    if preset is not None and arch is not None:
        raise ValueError("tally.ab.run: preset and arch name the same thing: give one")
    named = isinstance(model, str)
    if checkpoint is None:
        checkpoint = ["none", "blocks"] if named else ["none"]
    if precision is None:
        precision = amp if amp is not None else ["off", "bf16"]
    if out is None:
        out = tempfile.mkdtemp(prefix="tally_ab_")
    options = dict(checkpoint=_list(checkpoint), precision=_list(precision),
                   optimizer=_list(optimizer), offload=_list(offload),
                   step_in_backward=_list(step_in_backward, bool),
                   grad_accum=_list(grad_accum, int), alloc_conf=_list(alloc_conf),
                   steps=steps, batch=batch, seed=seed, lr=lr, rounds=rounds, device=device,
                   estimate=estimate, out=str(out), title=title, verbose=bool(verbose),
                   memory_budget=memory_budget,
                   preset=preset if preset is not None else arch)
    for k, v in model_options.items():
        if k not in ("image_size", "seq", "num_classes", "in_channels", "fused_classifier"):
            raise TypeError(f"tally.ab.run() got an unexpected keyword argument {k!r}")
        options[k] = v
    if not named and options["preset"] is not None:
        raise ValueError("tally.ab.run: preset names a registry model's preset; model is not a name")
    result = _C._ab.run(model, step, eval, data, {k: v for k, v in options.items() if v is not None})
    text = result.table
    if result.headlines:
        text += "what each option bought, against " + result.configs[0].name + ":\n"
        text += "".join("  " + h + "\n" for h in result.headlines)
    report = Report(out, text)
    report.headlines = list(result.headlines)
    report.table = result.table
    return report
