#!/usr/bin/env python3
"""Lane-level emulation of qmv_mma.cu (crates/mlxcel-core/kernels/cuda), no GPU needed.

    pip install numpy && python3 xtask/bench/cuda/qmv_mma_emulate.py

Replays the kernel's index plumbing lane by lane in numpy, as the source writes it: the
cp.async copies into the XOR-swizzled per-warp stage ring, ldmatrix.x4 (lane 8i+r gives row r
of matrix i; lane 4g+t receives bytes 4t..4t+3 of row g of each), the nibble-pair codes, the
PRMT pairing of activations, mma.sync.m16n8k16 fragments as the PTX ISA lays them out
("Matrix Fragments for mma.m16n8k16 with floating point type"), the one-step-ahead scale/bias
loads and their shuffles at the group fold, the all-ones mma's activation sums, and the
cross-warp reduction. Compares with x @ (scale * q + bias)^T in float64 over tails (N not a
multiple of 16, K not a multiple of 128, idle warps), gs 32/64/128, 1 or 2 activation tiles
and 1 or 2 row tiles; and qmm_gather (rows sorted by expert id, a 16-row tile split into runs
of one expert each) against each row times its expert's matrix. Keep it in step with the kernel when its layout changes. It checks the
indexing, not the hardware semantics it assumes (those are the PTX ISA's).
"""

import sys

import numpy as np

rng=np.random.default_rng(0)
QS=4; QC=4
def run(N,K,M,gs,NW,RT,NT,E=None):
    """E None: qmv_mma over M rows. E experts: qmm_gather over M rows with sorted expert ids."""
    words=K//8; groups=K//gs
    L=1 if E is None else E
    q=rng.integers(0,16,size=(L,N,K))
    w=np.zeros((L,N,words),dtype=np.uint64)
    for j in range(8): w|= (q[:,:,j::8].astype(np.uint64) << np.uint64(4*j))
    w=w.astype(np.uint32)
    sc=rng.standard_normal((L,N,groups)); bi=rng.standard_normal((L,N,groups)); x=rng.standard_normal((M,K))
    deq=np.repeat(sc,gs,axis=2)*q + np.repeat(bi,gs,axis=2)
    ids=np.zeros(M,dtype=np.int64) if E is None else np.sort(rng.integers(0,E,size=M)**2//E)
    ref=np.stack([x[m] @ deq[ids[m]].T for m in range(M)])
    out=np.full((M,N),np.nan)
    ROWS=16*RT; ROWB=QC*16; STB=ROWS*ROWB; COPIES=ROWS*QC//32; MC=8*NT
    cpr=words//4; steps=(cpr+QC-1)//QC; cpg=gs//32
    wbytes=w.view(np.uint8).reshape(L,N,words*4)
    def tile(n0,m_begin,m_end,wbytes,sc,bi):
        """One block: features n0.. of one matrix against rows m_begin..m_end-1 (qmm_tile)."""
        red=np.zeros((NW,ROWS,MC))
        for warp in range(NW):
            smem=np.zeros((QS,STB),dtype=np.uint8)
            def issue(s,stage):
                if s>=steps: return
                for lane in range(32):
                    for i in range(COPIES):
                        idx=i*32+lane; row=idx>>2; ch=idx&3
                        n=min(n0+row,N-1); c=s*QC+ch
                        dst=row*ROWB+((ch^((row>>1)&3))*16)
                        smem[stage,dst:dst+16]= wbytes[n,c*16:c*16+16] if c<cpr else 0
            def load_x(s):
                xv={}
                for lane in range(32):
                    g,t=lane>>2,lane&3
                    for c in range(QC):
                        for h in range(NT):
                            m=min(m_begin+g+8*h,m_end-1); ch=s*QC+c
                            xv[lane,c,h]= x[m,ch*32+8*t:ch*32+8*t+8] if (s<steps and ch<cpr) else np.zeros(8)
                return xv
            def load_sb(s):
                sb={}
                ins=QC//cpg; first=s*ins
                for lane in range(32):
                    g,t=lane>>2,lane&3
                    grp=min(first+min(t,ins-1),groups-1)
                    for r in range(RT):
                        nl=n0+r*16+g; na=min(nl,N-1); nb=min(nl+8,N-1)
                        sb[lane,r]=(sc[na,grp],bi[na,grp],sc[nb,grp],bi[nb,grp])
                return sb
            acc=np.zeros((32,RT,NT,4)); cq=np.zeros((32,RT,NT,4)); cs=np.zeros((32,NT,4))
            for p in range(QS-1): issue(warp+p*NW,p)
            xv=load_x(warp); sbv=load_sb(warp)
            i=0; s=warp
            while s<steps:
                issue(s+(QS-1)*NW,(i+QS-1)%QS)
                xn=load_x(s+NW); sbn=load_sb(s+NW)
                stage=i%QS
                for pair in range(QC//2):
                    wr={}
                    for r in range(RT):
                        rows_data=[[None]*8 for _ in range(4)]
                        for L in range(32):
                            lm_row=((L>>3)&1)*8+(L&7); lm_chunk=L>>4
                            row=r*16+lm_row; ch=2*pair+lm_chunk
                            a=row*ROWB+((ch^((row>>1)&3))*16)
                            rows_data[L>>3][L&7]=smem[stage,a:a+16]
                        for L in range(32):
                            g,t=L>>2,L&3
                            wr[L,r]=[int(rows_data[mi][g][4*t:4*t+4].view(np.uint32)[0]) for mi in range(4)]
                    for half in range(2):
                        c=2*pair+half; chunk=s*QC+c
                        if chunk>=cpr: break
                        # per-lane B regs
                        def codes(wd,sh): return ((wd>>sh)&0xF, (wd>>(sh+16))&0xF)
                        def mma(Aregs,Bregs,C):  # Aregs[lane]=4 pairs; Bregs[lane]=2 pairs; C[lane]=4
                            A=np.zeros((16,16)); B=np.zeros((16,8))
                            for L in range(32):
                                g,t=L>>2,L&3
                                a=Aregs[L]
                                # a0,a1 reg0 row g cols 2t,2t+1; reg1 row g+8; reg2 row g cols 2t+8; reg3 row g+8 cols 2t+8
                                for ri,(rr,cc) in enumerate([(g,2*t),(g+8,2*t),(g,2*t+8),(g+8,2*t+8)]):
                                    A[rr,cc]=a[ri][0]; A[rr,cc+1]=a[ri][1]
                                b=Bregs[L]
                                B[2*t,g]=b[0][0]; B[2*t+1,g]=b[0][1]; B[2*t+8,g]=b[1][0]; B[2*t+9,g]=b[1][1]
                            D=A@B
                            for L in range(32):
                                g,t=L>>2,L&3
                                C[L][0]+=D[g,2*t]; C[L][1]+=D[g,2*t+1]; C[L][2]+=D[g+8,2*t]; C[L][3]+=D[g+8,2*t+1]
                        b={}
                        for h in range(NT):
                            for L in range(32):
                                v=xv[L,c,h]  # x0..x7
                                b[L,h]=[(v[0],v[4]),(v[1],v[5]),(v[2],v[6]),(v[3],v[7])]
                            ones=[[(1,1)]*4]*32
                            Cs=[cs[L,h] for L in range(32)]
                            mma(ones,[b[L,h][0:2] for L in range(32)],Cs)
                            mma(ones,[b[L,h][2:4] for L in range(32)],Cs)
                        for r in range(RT):
                            a1=[]; a2=[]
                            for L in range(32):
                                lo,hi=wr[L,r][2*half],wr[L,r][2*half+1]
                                a1.append([codes(lo,0),codes(hi,0),codes(lo,4),codes(hi,4)])
                                a2.append([codes(lo,8),codes(hi,8),codes(lo,12),codes(hi,12)])
                            for h in range(NT):
                                Cq=[cq[L,r,h] for L in range(32)]
                                mma(a1,[b[L,h][0:2] for L in range(32)],Cq)
                                mma(a2,[b[L,h][2:4] for L in range(32)],Cq)
                        if (chunk+1)%cpg==0:
                            for L in range(32):
                                frm=(L&~3)|(c//cpg)
                                for r in range(RT):
                                    sa,ba,sb_,bb=sbv[frm,r]
                                    for h in range(NT):
                                        acc[L,r,h,0]+=sa*cq[L,r,h,0]+ba*cs[L,h,0]
                                        acc[L,r,h,1]+=sa*cq[L,r,h,1]+ba*cs[L,h,1]
                                        acc[L,r,h,2]+=sb_*cq[L,r,h,2]+bb*cs[L,h,0]
                                        acc[L,r,h,3]+=sb_*cq[L,r,h,3]+bb*cs[L,h,1]
                            cq[:]=0; cs[:]=0
                xv=xn; sbv=sbn; i+=1; s+=NW
            for L in range(32):
                g,t=L>>2,L&3
                for r in range(RT):
                    for h in range(NT):
                        for e in range(4):
                            red[warp, r*16+g+(e>>1)*8, h*8+2*t+(e&1)]=acc[L,r,h,e]
        for e in range(ROWS*MC):
            j=e//ROWS; m=m_begin+j; nl=e%ROWS; n=n0+nl
            if m<m_end and n<N: out[m,n]=red[:,nl,j].sum()
    if E is None:
        for blk in range((N+ROWS-1)//ROWS):
            tile(blk*ROWS,0,M,wbytes[0],sc[0],bi[0])
    else:
        # qmm_gather: blockIdx.x the 16-row tile, blockIdx.y the feature tile; each run of equal
        # ids in the tile through qmm_tile with that expert's matrix.
        for mt in range(0,M,16):
            last=min(mt+16,M)
            for blk in range((N+ROWS-1)//ROWS):
                m=mt
                while m<last:
                    e=ids[m]; end=m+1
                    while end<last and ids[end]==e: end+=1
                    tile(blk*ROWS,m,end,wbytes[e],sc[e],bi[e])
                    m=end
    err=np.abs(out-ref).max()/max(1,np.abs(ref).max())
    what=f"qmv_mma N{N}" if E is None else f"qmm_gather E{E} N{N}"
    print(f"{what} K{K} M{M} gs{gs} NW{NW} RT{RT} NT{NT}: rel err {err:.2e}", "OK" if err<1e-9 else "FAIL")
    return err<1e-9
ok=True
for (N,K) in [(48,64),(40,384),(16,1024)]:
    for gs in [32,64,128]:
        if K%gs: continue
        for M,NT in [(3,1),(8,1),(11,2),(16,2)]:
            for NW,RT in [(4,1),(8,1),(4,2)]:
                ok&=run(N,K,M,gs,NW,RT,NT)
for (E,N,K,M) in [(5,40,256,37),(3,16,384,16),(7,24,128,5)]:
    for gs in [32,64,128]:
        for NW,RT in [(4,1),(4,2)]:
            ok&=run(N,K,M,gs,NW,RT,2,E)
print("ALL OK" if ok else "SOME FAIL")
sys.exit(0 if ok else 1)
