# Host emulation of the FlashAttention-2 kernels' fragment index math in tensor/attention/cuda.cu
# (namespace fa2): ldmatrix (.x4, .trans) and mma.sync m16n8k16 are modelled lane by lane after
# the PTX ISA fragment layouts, the kernels' loops, lane address formulas, masks and the
# C-fragment -> A-fragment reuse are transcribed one to one, and the results are compared in
# float64 with reference attention (forward O and lse; backward dQ, dK, dV) for causal and not,
# L != S, partial tiles and head dims 40, 64, 120, 128. Run: python3 <this file> (needs numpy;
# a few minutes). Errors ~1e-15 mean every index is right; keep it in step with the kernels.
import numpy as np
L_ = np.arange(32)
G, Tq = L_ >> 2, L_ & 3

def ldsm(sm, ld, addr_fn, trans=False):
    # addr_fn(lane) -> (row, col); returns 4 regs, each [32, 2] (lo, hi)
    rc = [addr_fn(l) for l in range(32)]
    regs = []
    for i in range(4):
        r = np.zeros((32, 2))
        for lane in range(32):
            if not trans:
                row, col = rc[8 * i + lane // 4]
                r[lane, 0] = sm[row, col + 2 * (lane % 4)]
                r[lane, 1] = sm[row, col + 2 * (lane % 4) + 1]
            else:
                row0, col0 = rc[8 * i + 2 * (lane % 4)]
                row1, col1 = rc[8 * i + 2 * (lane % 4) + 1]
                r[lane, 0] = sm[row0, col0 + lane // 4]
                r[lane, 1] = sm[row1, col1 + lane // 4]
        regs.append(r)
    return regs

def mma(c, a, b0, b1):
    # c: [4][32] floats list of arrays; a: 4 regs [32,2]; b0,b1 [32,2]
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2*t:2*t+2] = a[0][lane]; A[g+8, 2*t:2*t+2] = a[1][lane]
        A[g, 2*t+8:2*t+10] = a[2][lane]; A[g+8, 2*t+8:2*t+10] = a[3][lane]
        B[2*t:2*t+2, g] = b0[lane]; B[2*t+8:2*t+10, g] = b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[0][lane] += C[g, 2*t]; c[1][lane] += C[g, 2*t+1]
        c[2][lane] += C[g+8, 2*t]; c[3][lane] += C[g+8, 2*t+1]

def zeros_c(n): return [[np.zeros(32) for _ in range(4)] for _ in range(n)]

def c_to_a(c0, c1):
    pk = lambda x, y: np.stack([x, y], 1)
    return [pk(c0[0], c0[1]), pk(c0[2], c0[3]), pk(c1[0], c1[1]), pk(c1[2], c1[3])]

A_OFF = lambda lane: ((lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8)       # A / trans-B
B_OFF = lambda lane: ((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8)       # non-trans B / trans-A

def warp_s_tile(sa, sb, w, D):
    # One warp's 16 x 64 tile of sa @ sb^T (rows w*16.. of sa, the 64 rows of sb, D columns) as
    # 8 C fragments of n8: the kernels' Q K^T (forward), K Q^T and V dO^T (backward) loops.
    s = zeros_c(8)
    for kk in range(D // 16):
        a = ldsm(sa, None, lambda l_: (w*16 + A_OFF(l_)[0], kk*16 + A_OFF(l_)[1]))
        for np_ in range(4):
            b = ldsm(sb, None, lambda l_: (np_*16 + B_OFF(l_)[0], kk*16 + B_OFF(l_)[1]))
            mma(s[2*np_], a, b[0], b[1]); mma(s[2*np_+1], a, b[2], b[3])
    return s

def mma_b_trans(acc, a, sb, kk, c0, n16):
    # acc += a @ sb[kk*16:kk*16+16, c0:c0+n16*16], B loaded by ldmatrix .trans (row-major in
    # shared memory): acc[2*dp], acc[2*dp+1] are the n8 halves of column block dp.
    for dp in range(n16):
        b = ldsm(sb, None, lambda l_: (kk*16 + A_OFF(l_)[0], c0 + dp*16 + A_OFF(l_)[1]), trans=True)
        mma(acc[2*dp], a, b[0], b[1]); mma(acc[2*dp+1], a, b[2], b[3])

def tile(src, r0, rows, D, E):
    out = np.zeros((rows, D))
    n = src.shape[0]
    for r in range(rows):
        if r0 + r < n: out[r, :E] = src[r0 + r, :E]
    return out

def fwd(q, k, v, causal, scale, D):
    Lq, E = q.shape; S = k.shape[0]
    O = np.zeros((Lq, E)); LSE = np.zeros(Lq)
    M, N = 128, 64
    sl = scale * np.log2(np.e)
    for q0 in range(0, Lq, M):
        sQ = tile(q, q0, M, D, E)
        nt = (S + N - 1) // N
        if causal: nt = min(nt, (min(q0 + M, Lq) - 1) // N + 1)
        for w in range(8):
            wr0 = q0 + 16 * w
            if wr0 >= Lq: continue
            o = zeros_c(D // 8); m = [np.full(32, -np.inf)] * 2; l = [np.zeros(32)] * 2
            m = list(m); l = list(l)
            for j in range(nt):
                k0 = j * N
                if causal and k0 > wr0 + 15: continue
                kb = tile(k, k0, N, D, E); vb = tile(v, k0, N, D, E)
                s = warp_s_tile(sQ, kb, w, D)
                masked = k0 + N > S or (causal and k0 + N - 1 > wr0)
                for n in range(8):
                    for e in range(4):
                        val = s[n][e] * sl
                        if masked:
                            col = k0 + n*8 + 2*Tq + (e & 1); row = wr0 + G + (e >> 1)*8
                            bad = (col >= S) | ((row < col) if causal else False)
                            val = np.where(bad, -np.inf, val)
                        s[n][e] = val
                for r in range(2):
                    mx = m[r].copy()
                    for n in range(8): mx = np.maximum(mx, np.maximum(s[n][2*r], s[n][2*r+1]))
                    mx = np.maximum(mx, mx[L_ ^ 1]); mx = np.maximum(mx, mx[L_ ^ 2])
                    mref = np.where(mx == -np.inf, 0, mx)
                    alpha = np.exp2(m[r] - mref); m[r] = mx
                    sm_ = np.zeros(32)
                    for n in range(8):
                        s[n][2*r] = np.exp2(s[n][2*r] - mref); s[n][2*r+1] = np.exp2(s[n][2*r+1] - mref)
                        sm_ += s[n][2*r] + s[n][2*r+1]
                    l[r] = l[r] * alpha + sm_
                    for n in range(D // 8): o[n][2*r] = o[n][2*r] * alpha; o[n][2*r+1] = o[n][2*r+1] * alpha
                for kk in range(4):
                    a = c_to_a(s[2*kk], s[2*kk+1])
                    mma_b_trans(o, a, vb, kk, 0, D // 16)
            for r in range(2):
                l[r] = l[r] + l[r][L_ ^ 1]; l[r] = l[r] + l[r][L_ ^ 2]
            sO = np.zeros((16, D))
            for n in range(D // 8):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    inv0 = 1 / l[0][lane] if l[0][lane] > 0 else 0
                    inv1 = 1 / l[1][lane] if l[1][lane] > 0 else 0
                    sO[g, n*8+2*t] = o[n][0][lane]*inv0; sO[g, n*8+2*t+1] = o[n][1][lane]*inv0
                    sO[g+8, n*8+2*t] = o[n][2][lane]*inv1; sO[g+8, n*8+2*t+1] = o[n][3][lane]*inv1
            for r in range(16):
                if wr0 + r < Lq: O[wr0 + r] = sO[r, :E]
            for lane in range(0, 32, 4):
                for r in range(2):
                    row = wr0 + (lane >> 2) + r*8
                    if row < Lq: LSE[row] = (m[r][lane] + np.log2(l[r][lane])) * np.log(2) if l[r][lane] > 0 else -np.inf
    return O, LSE

def bwd(q, k, v, dout, out, lse, causal, scale, D):
    Lq, E = q.shape; S = k.shape[0]
    dQ = np.zeros((Lq, E)); dK = np.zeros((S, E)); dV = np.zeros((S, E))
    dvec_all = (dout * out).sum(1)
    sl = scale * np.log2(np.e); N = 64
    qtiles = (Lq + N - 1) // N
    for k0 in range(0, S, 64):
        sK = tile(k, k0, 64, D, E); sV = tile(v, k0, 64, D, E)
        dk = [zeros_c(D // 8) for _ in range(4)]; dv = [zeros_c(D // 8) for _ in range(4)]
        qt0 = k0 // N if causal else 0
        for qt in range(qt0, qtiles):
            q0 = qt * N
            qb = tile(q, q0, N, D, E); dob = tile(dout, q0, N, D, E)
            lse2 = np.array([lse[q0+i] * np.log2(np.e) if q0+i < Lq else 0 for i in range(N)])
            dvec = np.array([dvec_all[q0+i] if q0+i < Lq else 0 for i in range(N)])
            sdS = np.zeros((64, 64 + 8))
            for w in range(4):
                wk0 = k0 + 16*w
                s = warp_s_tile(sK, qb, w, D)
                masked = q0 + N > Lq or k0 + 64 > S or (causal and k0 + 63 > q0)
                for n in range(8):
                    for e in range(4):
                        qc = n*8 + 2*Tq + (e & 1)
                        pr = np.exp2(s[n][e]*sl - lse2[qc])
                        if masked:
                            key = wk0 + G + (e >> 1)*8; qq = q0 + qc
                            bad = (key >= S) | (qq >= Lq) | ((key > qq) if causal else False)
                            pr = np.where(bad, 0, pr)
                        s[n][e] = pr
                pa = []
                for kk in range(4):
                    pa.append(c_to_a(s[2*kk], s[2*kk+1]))
                    mma_b_trans(dv[w], pa[kk], dob, kk, 0, D // 16)
                ds = warp_s_tile(sV, dob, w, D)
                for n in range(8):
                    p01 = pa[n//2][(n % 2)*2]; p23 = pa[n//2][(n % 2)*2 + 1]
                    d0 = dvec[n*8 + 2*Tq]; d1 = dvec[n*8 + 2*Tq + 1]
                    ds[n][0] = p01[:, 0]*(ds[n][0]-d0)*scale; ds[n][1] = p01[:, 1]*(ds[n][1]-d1)*scale
                    ds[n][2] = p23[:, 0]*(ds[n][2]-d0)*scale; ds[n][3] = p23[:, 1]*(ds[n][3]-d1)*scale
                for kk in range(4):
                    a = c_to_a(ds[2*kk], ds[2*kk+1])
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        sdS[w*16+g, kk*16+2*t:kk*16+2*t+2] = a[0][lane]
                        sdS[w*16+g+8, kk*16+2*t:kk*16+2*t+2] = a[1][lane]
                        sdS[w*16+g, kk*16+8+2*t:kk*16+8+2*t+2] = a[2][lane]
                        sdS[w*16+g+8, kk*16+8+2*t:kk*16+8+2*t+2] = a[3][lane]
                    mma_b_trans(dk[w], a, qb, kk, 0, D // 16)
            for w in range(4):
                wq = q0 + 16*w
                if wq >= Lq: continue
                parts = 2 if D > 64 else 1; cols = D // parts
                for part in range(parts):
                    c0 = part * cols
                    dq = zeros_c(cols // 8)
                    for kk in range(4):
                        a = ldsm(sdS, None, lambda l_: (kk*16 + B_OFF(l_)[0], w*16 + B_OFF(l_)[1]), trans=True)
                        mma_b_trans(dq, a, sK, kk, c0, cols // 16)
                    for n in range(cols // 8):
                        if c0 + n*8 >= E: continue
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3; col = c0 + n*8 + 2*t
                            if wq + g < Lq: dQ[wq+g, col] += dq[n][0][lane]; dQ[wq+g, col+1] += dq[n][1][lane]
                            if wq + g + 8 < Lq: dQ[wq+g+8, col] += dq[n][2][lane]; dQ[wq+g+8, col+1] += dq[n][3][lane]
        for w in range(4):
            for n in range(D // 8):
                if n*8 >= E: continue
                for lane in range(32):
                    g, t = lane >> 2, lane & 3; col = n*8 + 2*t
                    for r in range(2):
                        key = k0 + 16*w + g + r*8
                        if key < S:
                            dK[key, col:col+2] = [dk[w][n][2*r][lane], dk[w][n][2*r+1][lane]]
                            dV[key, col:col+2] = [dv[w][n][2*r][lane], dv[w][n][2*r+1][lane]]
    return dQ, dK, dV

def ref(q, k, v, dout, causal, scale):
    Lq, S = q.shape[0], k.shape[0]
    s = q @ k.T * scale
    if causal: s = np.where(np.arange(S)[None, :] > np.arange(Lq)[:, None], -np.inf, s)
    mx = s.max(1, keepdims=True); p = np.exp(s - mx); l = p.sum(1, keepdims=True)
    P = p / l; O = P @ v; lse = (mx + np.log(l))[:, 0]
    dP = dout @ v.T; dS = P * (dP - (dout * O).sum(1, keepdims=True)) * scale
    return O, lse, dS @ k, dS.T @ q, P.T @ dout

rng = np.random.default_rng(0)
import sys
for (Lq, S, E, causal) in [(150, 150, 64, True), (70, 130, 40, False), (130, 70, 128, True), (20, 90, 120, True)]:
    D = 64 if E <= 64 else 128
    q = rng.uniform(-2, 2, (Lq, E)); k = rng.uniform(-2, 2, (S, E)); v = rng.uniform(-2, 2, (S, E))
    do = rng.uniform(-1, 1, (Lq, E)); scale = 1 / np.sqrt(E)
    O, lse, dq, dk, dv = ref(q, k, v, do, causal, scale)
    O2, lse2 = fwd(q, k, v, causal, scale, D)
    dq2, dk2, dv2 = bwd(q, k, v, do, O, lse, causal, scale, D)
    err = lambda a, b: np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    print(Lq, S, E, causal, "O", err(O2, O), "lse", err(lse2, lse), "dq", err(dq2, dq), "dk", err(dk2, dk), "dv", err(dv2, dv), flush=True)
