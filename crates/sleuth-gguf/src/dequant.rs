//! ggml's tensor types and their dequantisation to f32.
//!
//! Each block format is decoded with the same f32 operations, in the same
//! order, as the `gguf` Python package (which `transformers` uses to load a
//! GGUF), so the results are bit-identical; the tests check that per type.
//! Block layouts follow ggml's `block_*` structs; "d" and "dmin" are f16
//! scales, "qs" packed low bits, "qh" high bits.

use half::f16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

const ALL: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Elements per block of the K-quants ("super-blocks").
const QK_K: usize = 256;

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        ALL.into_iter().find(|t| t.id() == id)
    }

    /// The `ggml_type` enum value stored in the file.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    pub fn supported_names() -> String {
        ALL.map(GgmlType::name).join(", ")
    }

    /// Elements per block.
    pub fn block_elements(self) -> u64 {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K as u64,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q2K => 16 + 64 + 2 + 2,
            GgmlType::Q3K => 32 + 64 + 12 + 2,
            GgmlType::Q4K => 2 + 2 + 12 + 128,
            GgmlType::Q5K => 2 + 2 + 12 + 32 + 128,
            GgmlType::Q6K => 128 + 64 + 16 + 2,
        }
    }

    pub fn byte_len(self, elements: u64) -> u64 {
        (elements / self.block_elements()).saturating_mul(self.block_bytes())
    }

    /// Decodes `raw` (whole blocks) into `out` (`raw`'s element count).
    pub fn dequantize(self, raw: &[u8], out: &mut [f32]) {
        let block = self.block_elements() as usize;
        assert_eq!(raw.len() as u64, self.byte_len(out.len() as u64), "{} bytes for {} elements", raw.len(), out.len());
        let blocks = raw.chunks_exact(self.block_bytes() as usize).zip(out.chunks_exact_mut(block));
        match self {
            GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = half(b, 0)),
            GgmlType::Bf16 => blocks.for_each(|(b, y)| y[0] = f32::from_bits(u32::from(le16(b, 0)) << 16)),
            GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
            GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
            GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
            GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
            GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
            GgmlType::Q2K => blocks.for_each(|(b, y)| q2_k(b, y)),
            GgmlType::Q3K => blocks.for_each(|(b, y)| q3_k(b, y)),
            GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
            GgmlType::Q5K => blocks.for_each(|(b, y)| q5_k(b, y)),
            GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
        }
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_bits(le16(b, at)).to_f32()
}

/// Element i of a 32-element block of nibbles: the low nibbles of the 16
/// bytes first, then the high nibbles.
fn nibble(qs: &[u8], i: usize) -> u8 {
    (qs[i % 16] >> (4 * (i / 16))) & 0x0F
}

/// d, qs[16]: (q - 8) * d
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (i, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(nibble(&b[2..], i) as i8 - 8);
    }
}

/// d, m, qs[16]: q * d + m
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for (i, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(nibble(&b[4..], i)) + m;
    }
}

/// The fifth bit of element i comes from bit i of the little-endian u32 `qh`.
fn five_bit(qh: &[u8], qs: &[u8], i: usize) -> u8 {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]) >> i & 1;
    nibble(qs, i) | (high as u8) << 4
}

/// d, qh[4], qs[16]: (q - 16) * d
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (i, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(five_bit(&b[2..6], &b[6..], i) as i8 - 16);
    }
}

/// d, m, qh[4], qs[16]: q * d + m
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for (i, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(five_bit(&b[4..8], &b[8..], i)) + m;
    }
}

/// d, qs[32] (i8): q * d
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (i, y) in y.iter_mut().enumerate() {
        *y = f32::from(b[2 + i] as i8) * d;
    }
}

/// scales[16] (4-bit scale, 4-bit min), qs[64] (2 bits), d, dmin.
/// Element e = half*128 + shift*32 + l reads bits 2*shift of qs[half*32 + l];
/// group e/16 scales it.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (half(b, 80), half(b, 82));
    for (e, y) in y.iter_mut().enumerate() {
        let (half_, shift, l) = (e / 128, e % 128 / 32, e % 32);
        let q = (qs[half_ * 32 + l] >> (2 * shift)) & 3;
        let g = e / 16;
        let dl = d * f32::from(scales[g] & 0x0F);
        let ml = dmin * f32::from(scales[g] >> 4);
        *y = dl * f32::from(q) - ml;
    }
}

/// hmask[32], qs[64] (2 bits), scales[12] (6-bit signed, packed), d.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[..32], &b[32..96], &b[96..108]);
    let d = half(b, 108);
    let scale = |i: usize| {
        let low = (packed[i % 8] >> (4 * (i / 8))) & 0x0F;
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        f32::from((low | high << 4) as i8 - 32)
    };
    for (e, y) in y.iter_mut().enumerate() {
        let (half_, shift, l) = (e / 128, e % 128 / 32, e % 32);
        let low = (qs[half_ * 32 + l] >> (2 * shift)) & 3;
        // The offset of 4 applies when the mask bit is clear.
        let high = ((hmask[l] >> (e / 32)) & 1) ^ 1;
        let q = low as i8 - (high << 2) as i8;
        *y = (d * scale(e / 16)) * f32::from(q);
    }
}

/// The eight 6-bit (scale, min) pairs of Q4_K and Q5_K, packed in 12 bytes.
fn scale_min_k4(packed: &[u8], g: usize) -> (u8, u8) {
    if g < 4 {
        (packed[g] & 0x3F, packed[g + 4] & 0x3F)
    } else {
        let (d, m, md) = (packed[g - 4], packed[g], packed[g + 4]);
        ((md & 0x0F) | ((d >> 2) & 0x30), (md >> 4) | ((m >> 2) & 0x30))
    }
}

/// d, dmin, scales[12], qs[128]: element e = c*64 + s*32 + l is nibble s of
/// qs[c*32 + l], in group e/32.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin, packed, qs) = (half(b, 0), half(b, 2), &b[4..16], &b[16..]);
    for (e, y) in y.iter_mut().enumerate() {
        let (c, s, l) = (e / 64, e % 64 / 32, e % 32);
        let q = (qs[c * 32 + l] >> (4 * s)) & 0x0F;
        let (sc, m) = scale_min_k4(packed, e / 32);
        *y = (d * f32::from(sc)) * f32::from(q) - dmin * f32::from(m);
    }
}

/// d, dmin, scales[12], qh[32], qs[128]: Q4_K plus a fifth bit, bit e/32 of qh[e % 32].
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin, packed, qh, qs) = (half(b, 0), half(b, 2), &b[4..16], &b[16..48], &b[48..]);
    for (e, y) in y.iter_mut().enumerate() {
        let (c, s, l) = (e / 64, e % 64 / 32, e % 32);
        let low = (qs[c * 32 + l] >> (4 * s)) & 0x0F;
        let high = (qh[l] >> (e / 32)) & 1;
        let (sc, m) = scale_min_k4(packed, e / 32);
        *y = (d * f32::from(sc)) * f32::from(low | high << 4) - dmin * f32::from(m);
    }
}

/// ql[128], qh[64], scales[16] (i8), d: element e = h*128 + s*64 + l (l < 64)
/// takes nibble s of ql[h*64 + l] and bits 2*(e%128/32) of qh[h*32 + e%32].
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    for (e, y) in y.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, e % 128 / 64, e % 64);
        let low = (ql[h * 64 + l] >> (4 * s)) & 0x0F;
        let high = (qh[h * 32 + e % 32] >> (2 * (e % 128 / 32))) & 0x03;
        let q = (low | high << 4) as i8 - 32;
        *y = (d * f32::from(scales[e / 16] as i8)) * f32::from(q);
    }
}
