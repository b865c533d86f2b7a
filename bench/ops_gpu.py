#!/usr/bin/env python3
"""Per-op GPU comparison: Tally (bench_ops_cuda, CUDA events) against PyTorch eager on the
same shapes and dtypes, in one call on the GPU machine. Prints a table: Tally ms, PyTorch
ms, speed ratio (PyTorch time / Tally time: >= 1 means Tally is as fast or faster), the
floor (max of bytes over 4.3 TB/s and FLOPs over 790 TFLOP/s bf16 / ~60 TFLOP/s fp32) and
Tally's throughput (GB/s for memory-bound rows, TFLOP/s for compute-bound ones). Rows
named *_fwd_bwd time forward + autograd backward on both sides (.grad set to None first).

    python3 bench/ops_gpu.py BUILD_DIR [filter]
"""
import json
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = True  # both sides at PyTorch's default (Tally: cuda::cudnn_allow_tf32())


def t_ms(fn):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def rnd(*s, dtype=torch.float32):
    return torch.randn(*s, device=dev).to(dtype)


bf = torch.bfloat16
TORCH = {}


def case(op, shape, dtype):
    def deco(fn):
        TORCH[(op, shape, dtype)] = fn
        return fn
    return deco


def torch_cases():
    a, b = rnd(64, 256, 56, 56), rnd(64, 256, 56, 56)
    TORCH[("add", "[64,256,56,56]", "float32")] = lambda: a + b
    TORCH[("relu", "[64,256,56,56]", "float32")] = lambda: F.relu(a)
    TORCH[("copy", "[64,256,56,56]", "float32")] = lambda: a.clone()
    x = rnd(16, 1024, 3072, dtype=bf)
    TORCH[("gelu_tanh", "[16,1024,3072]", "bfloat16")] = lambda: F.gelu(x, approximate="tanh")
    r, s = rnd(16, 1024, 768, dtype=bf), rnd(16, 1024, 768, dtype=bf)
    TORCH[("add", "[16,1024,768]", "bfloat16")] = lambda: r + s
    r32 = rnd(16, 1024, 768)
    TORCH[("add_f32_bf16", "[16,1024,768]", "float32")] = lambda: r32 + s
    TORCH[("sum", "[16,1024,768]", "bfloat16")] = lambda: r.sum()
    for n in (768, 2304, 3072):
        gb = rnd(16384, n, dtype=bf)
        TORCH[("sum_dim0_f32", f"[16384,{n}]", "bfloat16")] = (lambda g: lambda: g.sum(0, dtype=torch.float32))(gb)
    xl, wl = rnd(16384, 768, dtype=bf), rnd(2304, 768, dtype=bf)
    TORCH[("linear", "[16384,768]x[2304,768]^T", "bfloat16")] = lambda: F.linear(xl, wl)
    x2, w2 = rnd(16384, 768), rnd(768, 768)
    TORCH[("linear", "[16384,768]x[768,768]^T", "float32")] = lambda: F.linear(x2, w2)
    xn, g, bb = rnd(16384, 768, dtype=bf), rnd(768), rnd(768)
    TORCH[("layer_norm", "[16384,768]", "bfloat16")] = lambda: F.layer_norm(xn, (768,), g.to(bf), bb.to(bf))
    logits = rnd(16384, 50257, dtype=bf)
    y = torch.randint(0, 50257, (16384,), device=dev)
    TORCH[("cross_entropy", "[16384,50257]", "bfloat16")] = lambda: F.cross_entropy(logits, y)
    xc, wc = rnd(64, 64, 56, 56), rnd(64, 64, 3, 3)
    TORCH[("conv2d", "[64,64,56,56]*[64,64,3,3]", "float32")] = lambda: F.conv2d(xc, wc, padding=1)
    bn = rnd(64, 256, 56, 56)
    rm, rv, gw, gb = torch.zeros(256, device=dev), torch.ones(256, device=dev), rnd(256), rnd(256)
    TORCH[("batch_norm", "[64,256,56,56]", "float32")] = lambda: F.batch_norm(bn, rm, rv, gw, gb, training=True)
    mp = rnd(64, 64, 112, 112)
    TORCH[("max_pool2d", "[64,64,112,112] k3 s2", "float32")] = lambda: F.max_pool2d(mp, 3, 2, 1)
    q, k, v = (rnd(16, 12, 1024, 64, dtype=bf) for _ in range(3))
    TORCH[("sdpa_causal", "[16,12,1024,64]", "bfloat16")] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    TORCH[("sdpa", "[16,12,1024,64]", "bfloat16")] = lambda: F.scaled_dot_product_attention(q, k, v)
    n = 64 << 20
    a64, b64 = rnd(n), rnd(n)
    h64, k64 = rnd(n, dtype=bf), rnd(n, dtype=bf)
    TORCH[("add", "[67108864]", "float32")] = lambda: a64 + b64
    TORCH[("mul", "[67108864]", "float32")] = lambda: a64 * b64
    s0 = torch.randn((), device=dev)
    TORCH[("mul_0d_tensor", "[67108864]", "float32")] = lambda: a64 * s0
    TORCH[("relu", "[67108864]", "float32")] = lambda: F.relu(a64)
    TORCH[("gelu", "[67108864]", "float32")] = lambda: F.gelu(a64)
    TORCH[("add", "[67108864]", "bfloat16")] = lambda: h64 + k64
    TORCH[("gelu", "[67108864]", "bfloat16")] = lambda: F.gelu(h64)

    def fwd_bwd(fn, leaves, grad):
        def run():
            for t in leaves:
                t.grad = None
            fn().backward(grad)
        return run

    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    gq = rnd(16, 12, 1024, 64, dtype=bf)
    TORCH[("sdpa_causal_fwd_bwd", "[16,12,1024,64]", "bfloat16")] = fwd_bwd(
        lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True), (qg, kg, vg), gq)
    q32, k32, v32 = (rnd(16, 12, 1024, 64) for _ in range(3))
    TORCH[("sdpa_causal", "[16,12,1024,64]", "float32")] = lambda: F.scaled_dot_product_attention(
        q32, k32, v32, is_causal=True)
    qg32, kg32, vg32 = (t.detach().clone().requires_grad_() for t in (q32, k32, v32))
    gq32 = rnd(16, 12, 1024, 64)
    TORCH[("sdpa_causal_fwd_bwd", "[16,12,1024,64]", "float32")] = fwd_bwd(
        lambda: F.scaled_dot_product_attention(qg32, kg32, vg32, is_causal=True), (qg32, kg32, vg32), gq32)
    xlg, wlg = xl.detach().clone().requires_grad_(), wl.detach().clone().requires_grad_()
    gl = rnd(16384, 2304, dtype=bf)
    TORCH[("linear_fwd_bwd", "[16384,768]x[2304,768]^T", "bfloat16")] = fwd_bwd(
        lambda: F.linear(xlg, wlg), (xlg, wlg), gl)
    blg = rnd(2304, dtype=bf).requires_grad_()
    TORCH[("linear_bias_fwd_bwd", "[16384,768]x[2304,768]^T+b", "bfloat16")] = fwd_bwd(
        lambda: F.linear(xlg, wlg, blg), (xlg, wlg, blg), gl)
    ma, mb = rnd(16, 12, 1024, 64, dtype=bf).requires_grad_(), rnd(16, 12, 64, 1024, dtype=bf).requires_grad_()
    gm = rnd(16, 12, 1024, 1024, dtype=bf)
    TORCH[("matmul_fwd_bwd", "[16,12,1024,64]x[16,12,64,1024]", "bfloat16")] = fwd_bwd(
        lambda: ma @ mb, (ma, mb), gm)
    xn32, gn32, bn32 = (t.requires_grad_() for t in (rnd(16384, 768), rnd(768), rnd(768)))
    dyn32, dyn16 = rnd(16384, 768), rnd(16384, 768, dtype=bf)
    TORCH[("layer_norm_fwd_bwd", "[16384,768]", "float32")] = fwd_bwd(
        lambda: F.layer_norm(xn32, (768,), gn32, bn32), (xn32, gn32, bn32), dyn32)
    TORCH[("layer_norm_to_bf16_fwd_bwd", "[16384,768]", "float32")] = fwd_bwd(
        lambda: F.layer_norm(xn32, (768,), gn32, bn32).to(bf), (xn32, gn32, bn32), dyn16)
    xcg, wcg = xc.detach().clone().requires_grad_(), wc.detach().clone().requires_grad_()
    gc = rnd(64, 64, 56, 56)
    TORCH[("conv2d_fwd_bwd", "[64,64,56,56]*[64,64,3,3]", "float32")] = fwd_bwd(
        lambda: F.conv2d(xcg, wcg, padding=1), (xcg, wcg), gc)

    # Attention with a key padding mask (bool, True = take part) and with grouped key/value
    # heads (LLaMA-1B: 32 query heads over 8, causal).
    mask = torch.randn(16, 1, 1, 1024, device=dev) >= 0
    TORCH[("sdpa_mask", "[16,12,1024,64] bool[16,1,1,1024]", "bfloat16")] = (
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    TORCH[("sdpa_mask_fwd_bwd", "[16,12,1024,64] bool[16,1,1,1024]", "bfloat16")] = fwd_bwd(
        lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask), (qg, kg, vg), gq)
    qa = rnd(8, 32, 2048, 64, dtype=bf)
    ka, va = rnd(8, 8, 2048, 64, dtype=bf), rnd(8, 8, 2048, 64, dtype=bf)
    TORCH[("sdpa_gqa_causal", "[8,32|8,2048,64]", "bfloat16")] = (
        lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True, enable_gqa=True))
    qag, kag, vag = (t.detach().clone().requires_grad_() for t in (qa, ka, va))
    ga = rnd(8, 32, 2048, 64, dtype=bf)
    TORCH[("sdpa_gqa_causal_fwd_bwd", "[8,32|8,2048,64]", "bfloat16")] = fwd_bwd(
        lambda: F.scaled_dot_product_attention(qag, kag, vag, is_causal=True, enable_gqa=True),
        (qag, kag, vag), ga)
    # The recurrent cells' fused gate steps: PyTorch's own fused CUDA kernels (what LSTMCell and
    # GRUCell run on CUDA), biases already in the projections as Tally's take them.
    Bc, Hc = 256, 1024
    gx, gh, c0 = rnd(Bc, 4 * Hc), rnd(Bc, 4 * Hc), rnd(Bc, Hc)
    TORCH[("lstm_cell_gates", "[256,4096]", "float32")] = (
        lambda: torch.ops.aten._thnn_fused_lstm_cell(gx, gh, c0))
    gxg, ghg, c0g = (t.detach().clone().requires_grad_() for t in (gx, gh, c0))
    dh = rnd(Bc, Hc)

    def lstm_cell_sum():
        hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(gxg, ghg, c0g)
        return hy + cy
    TORCH[("lstm_cell_gates_fwd_bwd", "[256,4096]", "float32")] = fwd_bwd(
        lstm_cell_sum, (gxg, ghg, c0g), dh)
    rx, rh, h0 = rnd(Bc, 3 * Hc), rnd(Bc, 3 * Hc), rnd(Bc, Hc)
    TORCH[("gru_cell_gates", "[256,3072]", "float32")] = (
        lambda: torch.ops.aten._thnn_fused_gru_cell(rx, rh, h0))
    rxg, rhg, h0g = (t.detach().clone().requires_grad_() for t in (rx, rh, h0))
    TORCH[("gru_cell_gates_fwd_bwd", "[256,3072]", "float32")] = fwd_bwd(
        lambda: torch.ops.aten._thnn_fused_gru_cell(rxg, rhg, h0g)[0], (rxg, rhg, h0g), dh)
    # Whole layers: the LSTM LM's 2 x 650 at batch 64, 35 steps (cuDNN on PyTorch's side, TF32
    # off for these rows alone, as Tally's float32 products).
    def no_tf32(run):
        def wrapped():
            prev = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            try:
                run()
            finally:
                torch.backends.cudnn.allow_tf32 = prev
        return wrapped

    lstm = torch.nn.LSTM(650, 650, 2, batch_first=True, device=dev)
    gru = torch.nn.GRU(650, 650, 2, batch_first=True, device=dev)
    # Names of their own: the lambdas read them when the rows run, after every case is built.
    rnn_x = rnd(64, 35, 650).requires_grad_()
    rnn_g = rnd(64, 35, 650)
    rnn_x0 = rnn_x.detach()
    TORCH[("lstm_fwd_bwd", "[64,35,650] 2 layers", "float32")] = no_tf32(fwd_bwd(
        lambda: lstm(rnn_x)[0], (rnn_x, *lstm.parameters()), rnn_g))
    TORCH[("gru_fwd_bwd", "[64,35,650] 2 layers", "float32")] = no_tf32(fwd_bwd(
        lambda: gru(rnn_x)[0], (rnn_x, *gru.parameters()), rnn_g))

    def rnn_forward(layer):
        def run():
            with torch.no_grad():
                layer(rnn_x0)
        return no_tf32(run)
    TORCH[("lstm_fwd", "[64,35,650] 2 layers", "float32")] = rnn_forward(lstm)
    TORCH[("gru_fwd", "[64,35,650] 2 layers", "float32")] = rnn_forward(gru)
    # Indexing: gather along rows, an embedding's index_select and its backward's scatter_add;
    # scatter multiplying, index_add_ / index_fill_ of rows in place, cumprod along rows.
    xg = rnd(4096, 4096)
    ig = torch.randint(0, 4096, (4096, 1024), device=dev)
    TORCH[("gather", "[4096,4096] dim1 [4096,1024]", "float32")] = (
        lambda: torch.gather(xg, 1, ig))
    table = rnd(50304, 768)
    rows = torch.randint(0, 50304, (16384,), device=dev)
    TORCH[("index_select", "[50304,768] dim0 [16384]", "float32")] = (
        lambda: torch.index_select(table, 0, rows))
    src = rnd(16384, 768)
    sidx = torch.randint(0, 50304, (16384, 768), device=dev)
    TORCH[("scatter_add", "[50304,768] dim0 [16384,768]", "float32")] = (
        lambda: torch.scatter_add(table, 0, sidx, src))
    TORCH[("scatter_multiply", "[50304,768] dim0 [16384,768]", "float32")] = (
        lambda: torch.scatter(table, 0, sidx, src, reduce="multiply"))
    rows_table = table.clone()
    TORCH[("index_add_", "[50304,768] dim0 [16384]", "float32")] = (
        lambda: rows_table.index_add_(0, rows, src))
    TORCH[("index_fill_", "[50304,768] dim0 [16384]", "float32")] = (
        lambda: rows_table.index_fill_(0, rows, 0.5))
    TORCH[("cumprod", "[4096,4096] dim1", "float32")] = lambda: torch.cumprod(xg, 1)
    # F.interpolate: trilinear x2 of a 5-D volume and linear x2 of long 3-D rows, forward and
    # forward + backward.
    vol, seq = rnd(8, 32, 32, 64, 64), rnd(64, 256, 2048)
    TORCH[("interpolate_trilinear", "[8,32,32,64,64] x2", "float32")] = (
        lambda: F.interpolate(vol, scale_factor=2.0, mode="trilinear", align_corners=False))
    TORCH[("interpolate_linear", "[64,256,2048] x2", "float32")] = (
        lambda: F.interpolate(seq, scale_factor=2.0, mode="linear", align_corners=False))
    volg, seqg = vol.detach().clone().requires_grad_(), seq.detach().clone().requires_grad_()
    gvol, gseq = rnd(8, 32, 64, 128, 128), rnd(64, 256, 4096)
    TORCH[("interpolate_trilinear_fwd_bwd", "[8,32,32,64,64] x2", "float32")] = fwd_bwd(
        lambda: F.interpolate(volg, scale_factor=2.0, mode="trilinear", align_corners=False),
        (volg,), gvol)
    TORCH[("interpolate_linear_fwd_bwd", "[64,256,2048] x2", "float32")] = fwd_bwd(
        lambda: F.interpolate(seqg, scale_factor=2.0, mode="linear", align_corners=False),
        (seqg,), gseq)

    # group_norm (issue 50), groups 32: float16 [128,256,32,32] and the DDPM U-Net's
    # [128,128,32,32] (float32, bfloat16, and bfloat16 under autocast with float32 parameters,
    # as bench_train runs it); parameters in the input's dtype otherwise.
    for shape, dt in (((128, 256, 32, 32), torch.float16), ((128, 128, 32, 32), torch.float32),
                      ((128, 128, 32, 32), bf)):
        key, name = "[" + ",".join(map(str, shape)) + "] g32", str(dt).replace("torch.", "")
        xg, wg, bg = rnd(*shape, dtype=dt), rnd(shape[1], dtype=dt), rnd(shape[1], dtype=dt)
        TORCH[("group_norm", key, name)] = (lambda x, w, b: lambda: F.group_norm(x, 32, w, b))(xg, wg, bg)
        xr, wr, br = (t.detach().clone().requires_grad_() for t in (xg, wg, bg))
        TORCH[("group_norm_fwd_bwd", key, name)] = fwd_bwd(
            (lambda x, w, b: lambda: F.group_norm(x, 32, w, b))(xr, wr, br), (xr, wr, br), rnd(*shape, dtype=dt))
    xa = rnd(128, 128, 32, 32, dtype=bf).requires_grad_()
    wa, ba = rnd(128).requires_grad_(), rnd(128).requires_grad_()
    dya = rnd(128, 128, 32, 32)

    def group_norm_autocast():
        with torch.autocast("cuda", dtype=bf):
            return F.group_norm(xa, 32, wa, ba)
    TORCH[("group_norm_autocast_fwd_bwd", "[128,128,32,32] g32", "bfloat16")] = fwd_bwd(
        group_norm_autocast, (xa, wa, ba), dya)


    # LLaMA-1B's fused ops against HF's composites (bench_ops_cuda's rows of the same names).
    sw_g, sw_u = rnd(16384, 8192, dtype=bf), rnd(16384, 8192, dtype=bf)
    sw_dy = rnd(16384, 8192, dtype=bf)
    TORCH[("swiglu", "[16384,8192]", "bfloat16")] = lambda: F.silu(sw_g) * sw_u
    sw_gr, sw_ur = sw_g.detach().clone().requires_grad_(), sw_u.detach().clone().requires_grad_()
    TORCH[("swiglu_fwd_bwd", "[16384,8192]", "bfloat16")] = fwd_bwd(
        lambda: F.silu(sw_gr) * sw_ur, (sw_gr, sw_ur), sw_dy)
    rq, rcos, rsin = (rnd(8, 2048, 32, 64, dtype=bf), rnd(2048, 1, 64, dtype=bf),
                      rnd(2048, 1, 64, dtype=bf))
    rdq = rnd(8, 2048, 32, 64, dtype=bf)

    def rotary(x):
        return x * rcos + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * rsin
    TORCH[("rotary", "[8,2048,32,64] [2048,1,64]", "bfloat16")] = lambda: rotary(rq)
    rqg = rq.detach().clone().requires_grad_()
    TORCH[("rotary_fwd_bwd", "[8,2048,32,64] [2048,1,64]", "bfloat16")] = fwd_bwd(
        lambda: rotary(rqg), (rqg,), rdq)


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    filt = sys.argv[2] if len(sys.argv) > 2 else ""
    out = subprocess.run([f"{build}/bench/bench_ops_cuda", filt], capture_output=True, text=True)
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0:
        print(out.stderr[-2000:])
    torch_cases()
    print(f"{'op':<24} {'shape':<36} {'dtype':<9} {'tally ms':>9} {'torch ms':>9} {'ratio':>6} {'floor ms':>9} "
          f"{'GB/s|TF/s':>10}")
    for r in rows:
        key = (r["op"], r["shape"], r["dtype"])
        try:  # one PyTorch row that fails (an API gone in this release) keeps the table going
            tms = t_ms(TORCH[key]) if key in TORCH else float("nan")
        except Exception as e:  # noqa: BLE001
            print(f"{r['op']}: PyTorch's side failed: {type(e).__name__}: {str(e)[:100]}")
            tms = float("nan")
        if "error" in r:
            print(f"{r['op']:<24} {r['shape']:<36} {r['dtype']:<9} {'-':>9} {tms:9.3f}   (tally: {r['error'][:60]})")
            continue
        rate = f"{r['tflops']:6.1f} TF" if r.get("bound") == "compute" else f"{r['gbps']:7.0f} GB"
        print(f"{r['op']:<24} {r['shape']:<36} {r['dtype']:<9} {r['tally_ms']:9.3f} {tms:9.3f} "
              f"{tms / r['tally_ms']:6.2f} {r['floor_ms']:9.3f} {rate:>10}")
        r["torch_ms"] = tms
    print("JSON", json.dumps(rows))


if __name__ == "__main__":
    main()
