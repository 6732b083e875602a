/// A 64-bit checksum of a byte string, fed in pieces of any size. Fletcher-style over 64-bit
/// words in eight lanes (`a += word; b += a` per lane, on 64-byte blocks), so that it runs as
/// fast as the bytes arrive (the compiler turns the lanes into vector adds): a flipped bit
/// changes `a`, moved words change `b`. The lanes, the trailing bytes and the length are
/// mixed into the result. It detects corruption; it is no cryptographic signature.
#[derive(Clone)]
pub struct Hasher {
    a: [u64; 8],
    b: [u64; 8],
    len: u64,
    buf: [u8; 64],
    buffered: usize,
}

const K: [u64; 4] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F, 0x1656_67B1_9E37_79F9, 0x27D4_EB2F_1656_67C5];

impl Default for Hasher {
    fn default() -> Self {
        Hasher { a: [0; 8], b: [0; 8], len: 0, buf: [0; 64], buffered: 0 }
    }
}

impl Hasher {
    #[inline(always)]
    fn blocks(&mut self, data: &[u8]) {
        for w in data.chunks_exact(64) {
            for j in 0..8 {
                let x = u64::from_le_bytes(w[8 * j..8 * j + 8].try_into().unwrap());
                self.a[j] = self.a[j].wrapping_add(x);
                self.b[j] = self.b[j].wrapping_add(self.a[j]);
            }
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.len = self.len.wrapping_add(data.len() as u64);
        if self.buffered > 0 {
            let take = (64 - self.buffered).min(data.len());
            self.buf[self.buffered..self.buffered + take].copy_from_slice(&data[..take]);
            self.buffered += take;
            data = &data[take..];
            if self.buffered < 64 {
                return;
            }
            let b = self.buf;
            self.blocks(&b);
            self.buffered = 0;
        }
        let whole = data.len() / 64 * 64;
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: `data` holds whole/64 blocks; the CPU has AVX-512F; no copy (null dst).
            unsafe { hash_copy_avx512(&mut self.a, &mut self.b, data.as_ptr(), std::ptr::null_mut(), whole / 64) };
            let tail = &data[whole..];
            self.buf[..tail.len()].copy_from_slice(tail);
            self.buffered = tail.len();
            return;
        }
        self.blocks(&data[..whole]);
        let tail = &data[whole..];
        self.buf[..tail.len()].copy_from_slice(tail);
        self.buffered = tail.len();
    }

    /// `dst.copy_from_slice(src)` and `self.update(src)` in one pass over the bytes.
    pub fn copy_from(&mut self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "copy_from: lengths differ");
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if self.buffered == 0 && std::arch::is_x86_feature_detected!("avx512f") {
            let blocks = src.len() / 64;
            // SAFETY: both slices hold `blocks` 64-byte blocks; the CPU has AVX-512F.
            unsafe { hash_copy_avx512(&mut self.a, &mut self.b, src.as_ptr(), dst.as_mut_ptr(), blocks) };
            self.len = self.len.wrapping_add((blocks * 64) as u64);
            done = blocks * 64;
        }
        dst[done..].copy_from_slice(&src[done..]);
        self.update(&src[done..]);
    }

    pub fn finish(self) -> u64 {
        let mix = |h: u64, x: u64| (h ^ x).rotate_left(27).wrapping_mul(K[0] | 1).wrapping_add(K[1]);
        let mut h = mix(K[2], self.len);
        for j in 0..8 {
            h = mix(mix(h, self.a[j]), self.b[j]);
        }
        for &byte in &self.buf[..self.buffered] {
            h = mix(h, byte as u64 ^ K[3]);
        }
        h ^ (h >> 31)
    }
}

/// The lanes of `Hasher::blocks` in one register each (lane j of the vectors is word j of a
/// block, as in `blocks`), every block stored to `dst` as it goes unless `dst` is null: with
/// non-temporal stores when `dst` is 64-byte aligned (a state is far larger than the caches; its copy need not pass
/// through them), else plain ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn hash_copy_avx512(a: &mut [u64; 8], b: &mut [u64; 8], src: *const u8, dst: *mut u8, blocks: usize) {
    use std::arch::x86_64::*;
    let mut va = _mm512_loadu_si512(a.as_ptr() as *const _);
    let mut vb = _mm512_loadu_si512(b.as_ptr() as *const _);
    if !dst.is_null() && dst as usize % 64 != 0 && dst as usize % 4 == 0 && blocks > 1 {
        // A destination off the 64-byte grid (a Vec's buffer usually is, by 16 bytes): each
        // aligned 64-byte store takes the end of one source block and the start of the next.
        let head = 64 - dst as usize % 64;
        std::ptr::copy_nonoverlapping(src, dst, head);
        let s = (head / 4) as i32;
        let idx = _mm512_add_epi32(_mm512_set1_epi32(s), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        let mut prev = _mm512_loadu_si512(src as *const _);
        va = _mm512_add_epi64(va, prev);
        vb = _mm512_add_epi64(vb, va);
        for i in 1..blocks {
            let v = _mm512_loadu_si512(src.add(64 * i) as *const _);
            va = _mm512_add_epi64(va, v);
            vb = _mm512_add_epi64(vb, va);
            _mm512_stream_si512(dst.add(head + 64 * (i - 1)) as *mut _, _mm512_permutex2var_epi32(prev, idx, v));
            prev = v;
        }
        let done = head + 64 * (blocks - 1);
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), 64 * blocks - done);
        _mm_sfence();
        _mm512_storeu_si512(a.as_mut_ptr() as *mut _, va);
        _mm512_storeu_si512(b.as_mut_ptr() as *mut _, vb);
        return;
    }
    let stream = dst as usize % 64 == 0 && !dst.is_null();
    for i in 0..blocks {
        let v = _mm512_loadu_si512(src.add(64 * i) as *const _);
        va = _mm512_add_epi64(va, v);
        vb = _mm512_add_epi64(vb, va);
        if dst.is_null() {
            continue;
        }
        if stream {
            _mm512_stream_si512(dst.add(64 * i) as *mut _, v);
        } else {
            _mm512_storeu_si512(dst.add(64 * i) as *mut _, v);
        }
    }
    if stream {
        // Non-temporal stores are weakly ordered: fence before anyone else reads them.
        _mm_sfence();
    }
    _mm512_storeu_si512(a.as_mut_ptr() as *mut _, va);
    _mm512_storeu_si512(b.as_mut_ptr() as *mut _, vb);
}

/// The checksum of one byte string.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = Hasher::default();
    h.update(bytes);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_sees_a_flipped_bit_and_does_not_depend_on_the_pieces() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let base = checksum(&data);
        for i in [0, 31, 32, 500, 999] {
            let mut d = data.clone();
            d[i] ^= 0x10;
            assert_ne!(checksum(&d), base, "bit flip at {i}");
        }
        for cuts in [vec![1, 2, 3], vec![31, 33, 64], vec![500], vec![0, 999]] {
            let mut h = Hasher::default();
            let mut at = 0;
            for c in cuts.into_iter().chain([1000]) {
                h.update(&data[at..c]);
                at = c;
            }
            assert_eq!(h.finish(), base);
        }
        // Copying while hashing gives the same copy and the same checksum, in any pieces and
        // to a destination on or off the 64-byte grid.
        for shift in [0, 4, 16, 36, 60] {
            for cuts in [vec![1000], vec![64, 640, 1000], vec![3, 130, 1000]] {
                let mut buf = vec![0u8; 1000 + 128];
                let off = (64 - buf.as_ptr() as usize % 64) % 64 + shift;
                let (mut h, mut at) = (Hasher::default(), 0);
                for c in cuts {
                    h.copy_from(&mut buf[off + at..off + c], &data[at..c]);
                    at = c;
                }
                assert_eq!((h.finish(), &buf[off..off + 1000]), (base, &data[..]), "copy_from, destination 64k + {shift}");
            }
        }
        let mut swapped = data[500..].to_vec();
        swapped.extend(&data[..500]);
        assert_ne!(checksum(&swapped), base);
    }
}
