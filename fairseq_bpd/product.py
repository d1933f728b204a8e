"""Decoding's products x · W + b, on a weight arranged once (W C x N, contiguous).

At a few rows (up to COMPILED_MOST_ROWS) in float32 on a CPU, the compiled kernel's product
(kernels.py, csrc/few_rows.cpp) serves where it is built: it reads a copy of W packed for it
(`blocks`), split between the cores and fetched ahead, which was faster here than either
library's kernel below at one row to ninety-six.

Otherwise two CPU kernels compute them, and which is faster depends on the
machine. oneDNN's linear reads a weight it packed once (the kernel torch.compile uses on
CPUs after freezing), so a block of several rows costs little more than one; where MKL's
addmm packs W into its own layout on every call, that costs more than the product itself.
Where MKL computes small products directly, oneDNN's call costs more than it saves.
Product holds both: the packed copy where it applies (float32 on a CPU with oneDNN; not
under autograd), used for the row counts at which it measured faster on this machine
(packed_pays), MKL's addmm otherwise, float64 included, so the tests' exactness checks run
the same code paths' fallbacks. Either rounds differently from fairseq's own step, as any
block pass does. $FAIRSEQ_BPD_PACKED=0 turns the packed copies off (measurements of before
and after); =1 uses them wherever they apply, untimed.

When each switch is read: torch.backends.mkldnn's flag on every product, so that
`with torch.backends.mkldnn.flags(enabled=False)` runs no oneDNN inside it, whatever was
decoded before (a C call; the variable would cost a dictionary lookup and an encoding on
every product); $FAIRSEQ_BPD_PACKED when the weights are arranged: the first decoding after
a model is built, its weights change, or model.eval() (which drops what decoding arranged).
Set it before decoding, or call model.eval() after setting it.
"""
import math
import os
import time

import torch
import torch.nn.functional as F

from . import kernels

PACKED_VARIABLE = "FAIRSEQ_BPD_PACKED"
# oneDNN picks its weight layout for a row count; 32 served 1 to 128 rows alike (measured).
PACKING_ROWS = 32
# One row by a small weight is MKL's matrix-vector product, which oneDNN's call overhead
# does not beat (measured; not timed); from this size (an output projection) one row is
# timed too (packed_pays).
ONE_ROW_PACKED_SIZE = 1 << 20


# Past this many rows a product's weight is read once for many of them and the libraries'
# blocked kernels catch up (the compiled kernel multiplies four rows at a time; at 96 rows
# of the shipped model's layer shapes it still took 0.88x of either library's time).
COMPILED_MOST_ROWS = 128
PACKED_OUTPUTS = 64  # csrc/few_rows.cpp's block of outputs


def blocked(weight):
    """weight C x N as csrc/few_rows.cpp reads it: N/64 blocks of C x 64 (zero columns past
    N), contiguous: output n's weight for channel c at [n / 64][c][n % 64]."""
    blocks = -(-weight.size(1) // PACKED_OUTPUTS)  # N / 64, rounded up
    padded = F.pad(weight, (0, blocks * PACKED_OUTPUTS - weight.size(1)))
    return padded.view(weight.size(0), blocks, PACKED_OUTPUTS).transpose(0, 1).contiguous()


def int8_blocked(weight):
    """int8 weights C x N as csrc/few_rows.cpp's int8 products read them, shaped N/64 x C x
    64 with zero weights past N: where they run on VNNI (the kernels' int8_channel_group()
    is 4; C a multiple of 4), N/64 blocks of C/4 x 64 x 4, each output's weights for four
    channels side by side (one 32-bit lane of VNNI's dot product of unsigned bytes by signed
    ones), each weight plus 128 as an unsigned byte, stored as int8; elsewhere blocked(weight)."""
    blocks = blocked(weight)  # N/64 x C x 64
    kern = kernels.module()
    if kern is None or kern.int8_channel_group() != 4:
        return blocks
    count, channels = blocks.shape[:2]
    grouped = blocks.view(count, channels // 4, 4, PACKED_OUTPUTS).transpose(2, 3)  # ... x 64 outputs x 4
    return (grouped.to(torch.int16) + 128).to(torch.uint8).view(torch.int8).reshape(count, channels, PACKED_OUTPUTS)


def compiled_kernel(weight, bias, x):
    """The compiled kernels where their product serves x (M x C) by `weight` (C x N) and
    `bias`: float32 on a CPU, at most COMPILED_MOST_ROWS rows with contiguous channels, a
    contiguous bias of N, no autograd; else None."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2
            or x.size(0) > COMPILED_MOST_ROWS or x.stride(1) != 1 or weight.size(0) == 0
            or bias.dtype != torch.float32 or bias.numel() != weight.size(1) or not bias.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))):
        return None
    return kernels.module()


def packable(weight):
    """Whether a packed copy of `weight` (C x N) may serve decoding here, mkldnn's flag aside."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.requires_grad
            and os.environ.get(PACKED_VARIABLE, "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packing_applies(weight):
    """Whether a packed copy of `weight` (C x N) serves decoding here, now."""
    return packable(weight) and torch.backends.mkldnn.enabled


def pack(weight):
    """oneDNN's copy of `weight` (C x N), in its layout for PACKING_ROWS rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.t(), PACKING_ROWS)


# Which kernel is faster for a few rows is the machine's (measured: on an AMD EPYC the packed
# copy won from one row; on an Intel Xeon with AMX, MKL's addmm won every layer's product
# up to 4 rows, oneDNN's call costing more than the product). So, as torch.backends.cudnn.benchmark
# does, each weight shape, row count (rows_key) and thread count is timed once a process, on
# its first product, and keeps the faster kernel: PACKED_PAYS. From TIMED_MOST_ROWS rows on
# (an encoder's, a source's keys) a product reads its weight once for many rows and the packed
# copy serves untimed: a race there would cost many large products.
PACKED_PAYS = {}
TIMED_MOST_ROWS = 64
RACE_CALLS = 8  # a kernel's calls per round; each kernel's fastest of RACE_ROUNDS rounds counts
RACE_ROUNDS = 3


def rows_key(rows):
    """The row counts that share a timing: each up to 8, then powers of two (rows of a batch
    that shrinks as its sentences finish take every value)."""
    return rows if rows <= 8 else 1 << (rows - 1).bit_length()


def fastest(kernels):
    """The index of the fastest of `kernels` (callables of no argument): each run once to warm
    up, then RACE_ROUNDS rounds of RACE_CALLS calls each, the kernels' rounds interleaved (a
    burst of other work slows them alike), each kernel's best round counting."""
    for kernel in kernels:
        kernel()
    best = [math.inf] * len(kernels)
    for _ in range(RACE_ROUNDS):
        for i, kernel in enumerate(kernels):
            start = time.perf_counter()
            for _ in range(RACE_CALLS):
                kernel()
            best[i] = min(best[i], time.perf_counter() - start)
    return best.index(min(best))


def packed_pays(product, x):
    """Whether oneDNN's product on `product`'s packed copy is faster than MKL's addmm for x's
    rows (x M x C) on this machine at torch's threads now: timed on the first such product
    of the process (PACKED_PAYS), up to TIMED_MOST_ROWS rows. The kernel changes a product's
    float32 rounding, and where the two are about as fast a race may pick either: a run
    that must round alike every time sets $FAIRSEQ_BPD_PACKED=1 (Product.timed)."""
    rows = x.size(0)
    if rows >= TIMED_MOST_ROWS or x.dim() != 2 or rows == 0:
        return True
    own = (rows, torch.get_num_threads())  # the product's own memo: this runs on every product
    pays = product.pays.get(own)
    if pays is None:
        weight, bias = product
        key = (tuple(weight.shape), rows_key(rows), own[1])
        pays = PACKED_PAYS.get(key)
        if pays is None:
            pays = PACKED_PAYS[key] = fastest([
                lambda: torch.addmm(bias, x, weight),
                lambda: product.on_packed(x)]) == 1
        product.pays[own] = pays
    return pays


class Product(tuple):
    """(W C x N, bias N), as the code before it reads them, and x -> x · W + bias.

    A tuple, so that whatever slices W or the bias (a shortlist's columns) reads them as before.
    Packed when made where packing applies, else on the first product that may use it (made
    while mkldnn was disabled, used after), so that what a product computes never depends
    on the flag at the time the weights were arranged. lazy: packed on the first product that
    uses the packed copy in any case (a weight made per batch, which few products may read:
    oneDNN's packing costs many of them)."""

    def __new__(cls, weight, bias, lazy=False):
        self = super().__new__(cls, (weight, bias))
        self.packable = packable(weight)
        self.packed = pack(weight) if self.packable and torch.backends.mkldnn.enabled and not lazy else None
        self.pays = {}  # packed_pays's answers for this product, by rows and threads
        # $FAIRSEQ_BPD_PACKED=1: the packed copy wherever it applies, untimed (runs that must
        # round alike every time); 0: never; unset: the kernel timed faster (packed_pays)
        self.timed = os.environ.get(PACKED_VARIABLE) != "1"
        self.compiled = None  # blocked(W), for the compiled kernel: made on its first product
        return self

    def __reduce__(self):
        # copy.deepcopy and pickle rebuild it from (W, bias), packing the copy's own W anew:
        # a tuple subclass would otherwise be rebuilt from one argument, and the packed copy
        # (an opaque oneDNN tensor) cannot be copied.
        return Product, tuple(self)

    def __call__(self, x, out=None):
        """x M x C (rows at any stride) -> M x N, into `out` where given."""
        weight, bias = self
        kern = compiled_kernel(weight, bias, x)
        if kern is not None:
            return kern.float_product(x, self.blocks(), weight.size(1), bias, None, False, out)
        if not self.packs(x):
            return torch.addmm(bias, x, weight) if out is None else torch.addmm(bias, x, weight, out=out)
        y = self.on_packed(x)
        return y if out is None else out.copy_(y)

    def on_packed(self, x, activation="none"):
        """oneDNN's product on the packed copy, `activation` applied inside it; for callers that
        asked packs(x) already (it is on every product: asked once)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self[1], activation, [], "")

    def blocks(self):
        """W as the compiled kernel reads it (blocked), made once."""
        if self.compiled is None:
            self.compiled = blocked(self[0].detach())
        return self.compiled

    def relu(self, x):
        """relu(x · W + bias), x M x C: the compiled kernel and oneDNN's packed copy apply it
        inside their product (bit for bit, one operation fewer). Not so the residual sums:
        oneDNN's product that adds a matrix (mkldnn._linear_pointwise.binary) measured slower
        in the block pass than the product and an add."""
        kern = compiled_kernel(*self, x)
        if kern is not None:
            return kern.float_product(x, self.blocks(), self[0].size(1), self[1], None, True)
        if self.packs(x):
            return self.on_packed(x, "relu")
        return torch.relu(torch.addmm(self[1], x, self[0]))

    def packs(self, x):
        """Whether the product of x (M x C) runs on the packed copy, packing it now where it was
        put off: not for float64, autograd, another device, mkldnn's flag off, one row by a
        small weight (ONE_ROW_PACKED_SIZE), or rows for which MKL's addmm is faster here
        (packed_pays)."""
        weight = self[0]
        if (not self.packable or x.dtype != torch.float32 or x.requires_grad or x.device.type != "cpu"
                or x.size(0) == 1 and weight.numel() < ONE_ROW_PACKED_SIZE or not torch._C._get_mkldnn_enabled()):
            return False
        if self.packed is None:
            self.packed = pack(weight)
        return not self.timed or packed_pays(self, x)


REDUCED_VARIABLE = "FAIRSEQ_BPD_REDUCED"
INT8_MAX = 127
# torch's int8 weight-only kernel reads a product's C in blocks of 16: with another C it
# computes garbage or crashes (measured), so a weight's rows are padded to a multiple.
INT8_ROWS = 16
# Past this many rows a product reads its weight once for all of them, and oneDNN's packed
# float32 product is as fast or faster (measured): Int8Product runs a Product there.
INT8_MOST_ROWS = 4


def reducible(weight):
    """Whether an int8 copy of `weight` (C x N) may serve products whose exactness nothing
    needs (proposals, which verification checks): float32 on a CPU with torch's int8
    weight-only kernel, not under autograd. No bf16 instructions are asked for: where the CPU
    has none the kernel converts in software and still reads a quarter of float32's bytes,
    which pays on avx2-only CPUs too (measured). Read when the weights are arranged;
    $FAIRSEQ_BPD_REDUCED=0 turns it off (measurements of before and after). C a multiple of
    INT8_ROWS."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.requires_grad
            and weight.size(0) % INT8_ROWS == 0
            and os.environ.get(REDUCED_VARIABLE, "1") != "0" and hasattr(torch, "_weight_int8pack_mm"))


class Int8Product(tuple):
    """(W C x N, bias N or None) and x -> x · W + bias, W rounded to int8 per output column
    (symmetric, its largest magnitude at 127): at a row or a few a product reads its weight
    once per row, so a quarter of float32's bytes is most of its cost saved.

    The compiled kernel (kernels.py, csrc/few_rows.cpp) reads a copy packed for it
    (`packed`: int8_blocked): with VNNI it rounds each row to int8 too (its largest
    magnitude at 127) and sums the integer products exactly, scaled per output and per row;
    elsewhere it multiplies float32 rows by the weights, exactly converted, into float32
    sums. It adds a residual and applies relu in the same call (`add`, `relu`). Where it
    does not serve, torch's weight-only kernel runs (x rounded to bf16, bf16 scales; bf16 out
    where no bias is added, which a sum with float32 promotes). More rows than
    INT8_MOST_ROWS, and inputs neither kernel takes (float64, autograd), run the Product of
    W (a bias of zeros where none; lazy: Product's) on x in W's dtype."""

    def __new__(cls, weight, bias, lazy=False):
        if weight.size(0) % INT8_ROWS:
            raise ValueError(f"an Int8Product's weight needs rows in multiples of {INT8_ROWS}, not {weight.size(0)}")
        self = super().__new__(cls, (weight, bias))
        scales = weight.abs().amax(0).clamp_min(torch.finfo(weight.dtype).tiny) / INT8_MAX  # N
        self.quantized = (weight / scales).round_().to(torch.int8).t().contiguous()  # N x C
        self.scales, self.scales32 = scales.bfloat16(), scales.float().contiguous()
        self._packed = None  # int8_blocked, made on first use: its layout is the kernels' loaded then
        self.full = Product(weight, weight.new_zeros(weight.size(1)) if bias is None else bias, lazy)
        return self

    def __reduce__(self):
        return Int8Product, tuple(self)

    @property
    def packed(self):
        """The weights as the compiled kernel reads them (int8_blocked): N/64 x C x 64 bytes."""
        if self._packed is None:
            self._packed = int8_blocked(self.quantized.t())
        return self._packed

    def __call__(self, x, out=None, add=None, relu=False):
        """x M x C (columns contiguous) -> M x N (+ add, M x N) (relu), into `out` (float32)
        where given."""
        if (x.size(0) > INT8_MOST_ROWS or x.dtype not in (torch.float32, torch.bfloat16) or x.requires_grad
                or x.device.type != "cpu"):
            # In W's dtype: Product's matmul takes no mixed dtypes (float64 rows, W float32).
            return finish(self.full(x.to(self[0].dtype)), add, relu, out)
        kern = kernels.module() if x.dtype == torch.float32 else None
        if kern is not None:
            if x.stride(1) != 1:  # the kernel reads each row's channels in one run
                x = x.contiguous()
            return kern.int8_product(x, self.packed, self.scales32, self[1], add, relu, out)
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.quantized, self.scales)  # M x N, bf16
        return finish(y if self[1] is None else torch.add(y, self[1]), add, relu, out)


def finish(y, add, relu, out):
    """y + add (relu), into `out` where given: what Int8Product's kernel does in its
    product, after another's."""
    if add is not None:
        y = y + add
    if relu:
        y = torch.relu_(y)
    return y if out is None else out.copy_(y)
