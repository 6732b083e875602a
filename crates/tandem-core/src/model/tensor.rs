//! Weight storage: tensors stay in the dtype and the memory they were loaded into
//! (a memory-mapped safetensors or GGUF file, or a buffer of the synthetic generator).
//! No f32 copy of a weight matrix is ever made: the kernels read bf16 / f16 / f32, int8 and
//! GGML's block formats directly.

use std::fmt;
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::model::blocks::{self, BlockFormat};

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
    /// Weight-only int8 with one f32 scale per output row (`--quant int8`).
    I8,
    /// A GGML block format: each row a run of blocks (a GGUF file's quantized tensors, or
    /// `--quant q4_k` and its siblings).
    Blocks(BlockFormat),
}

impl DType {
    /// Bytes of `elements` values (for a block format, a whole number of its blocks).
    pub fn bytes_of(self, elements: usize) -> usize {
        match self {
            DType::I8 => elements,
            DType::BF16 | DType::F16 => 2 * elements,
            DType::F32 => 4 * elements,
            DType::Blocks(f) => f.bytes_of(elements),
        }
    }

    /// Bits a value takes (4.5 for Q4_K, its scales included).
    pub fn bits_per_value(self) -> f64 {
        match self {
            DType::Blocks(f) => f.bits_per_value(),
            other => 8.0 * other.bytes_of(1) as f64,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I8 => "int8",
            DType::Blocks(b) => return write!(f, "{}", b.name().to_ascii_lowercase()),
        })
    }
}

/// Something that owns bytes which never move: a memory map or a heap buffer.
pub trait Storage: Send + Sync {
    fn bytes(&self) -> &[u8];
    /// Tell the OS that bytes `offset..offset + len` will not be read again (their pages leave
    /// the process's resident set). Used after a tensor was quantized to a new buffer.
    fn release(&self, _offset: usize, _len: usize) {}
    /// Whether the bytes are a file's pages (a memory map) rather than memory of the process's own.
    fn is_file(&self) -> bool {
        false
    }
}

impl Storage for memmap2::Mmap {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn is_file(&self) -> bool {
        true
    }
    fn release(&self, offset: usize, len: usize) {
        // Page-align inward: neighbouring tensors may share the edge pages.
        let page = 4096;
        let start = offset.div_ceil(page) * page;
        let end = ((offset + len) / page) * page;
        if end > start {
            // SAFETY: the mapping is read-only and file-backed: dropped pages are re-read from
            // the file if ever touched again, so no data is lost.
            let _ = unsafe { self.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }
}

/// A heap buffer of u16 (bf16/f16 bits) or f32 values, kept at its natural alignment.
pub struct HeapStorage<T: Copy + Send + Sync + 'static>(pub Vec<T>);

impl<T: Copy + Send + Sync + 'static> Storage for HeapStorage<T> {
    fn bytes(&self) -> &[u8] {
        // SAFETY: T is a plain numeric type (u16, f32, i8, ...); viewing it as bytes is sound.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, std::mem::size_of_val(&self.0[..])) }
    }
}

/// `len` zeros in memory that the kernel backs with 2 MB pages where it can (Linux with
/// transparent huge pages in `madvise` mode or on; elsewhere plain pages). A decode step reads
/// every weight once, four streams at a time per core: in 4 KB pages that is a TLB miss every
/// few rows of a stream, and the hardware prefetchers stop at each page's end. In 2 MB pages
/// the 0.8B's decode ran 3.5-4.6% faster on 16 Xeon cores (medians of five interleaved
/// `tandem bench` runs) and bf16 4.6% faster on a 2-vCPU EPYC
/// (docs/results/2026-11-29-cpu-decode-huge-pages.md).
pub fn zeroed_in_huge_pages<T: Copy + Default>(len: usize) -> Vec<T> {
    // A large zeroed allocation comes straight from fresh mapped memory, none of it touched
    // yet, so the advice takes effect as the pages are first written.
    let v = vec![T::default(); len];
    advise_huge_pages(v.as_ptr() as *const u8, std::mem::size_of_val(&v[..]));
    v
}

/// Ask for 2 MB pages over the whole 2 MB pages inside `len` bytes at `p`. Only advice: a
/// kernel without transparent huge pages, or without free 2 MB pages, leaves 4 KB pages.
fn advise_huge_pages(p: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (p as usize).next_multiple_of(HUGE);
        let end = (p as usize + len) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside an allocation this process owns; MADV_HUGEPAGE
            // changes how pages are backed, never their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, len);
}

/// `bytes` (at any alignment) as `T` values in a buffer of 2 MB pages (`zeroed_in_huge_pages`),
/// copied on every core: a checkpoint's largest matrices are gigabytes, and the first write to
/// each new page also has the kernel clear it.
fn copy_into_huge_pages<T: Copy + Default>(bytes: &[u8]) -> Vec<T> {
    let mut copy: Vec<T> = zeroed_in_huge_pages(bytes.len() / std::mem::size_of::<T>());
    // SAFETY: the buffer's own bytes; T is plain data (u16, f32, i8, i32), any bits a value.
    let dst = unsafe { std::slice::from_raw_parts_mut(copy.as_mut_ptr() as *mut u8, std::mem::size_of_val(&copy[..])) };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = dst.len().div_ceil(threads).max(2 << 20);
    std::thread::scope(|s| {
        for (dst, src) in dst.chunks_mut(chunk).zip(bytes.chunks(chunk)) {
            s.spawn(move || dst.copy_from_slice(src));
        }
    });
    copy
}

/// A typed, read-only slice into a `Storage` that the slice keeps alive.
#[derive(Clone)]
pub struct Buf<T: Copy + 'static> {
    // Keeps the bytes behind `ptr` alive, and says whether they are a file's pages.
    owner: Arc<dyn Storage>,
    ptr: *const T,
    len: usize,
}

// SAFETY: the pointee is immutable and owned by `owner`, which is Send + Sync.
unsafe impl<T: Copy + Sync> Send for Buf<T> {}
unsafe impl<T: Copy + Sync> Sync for Buf<T> {}

impl<T: Copy + Send + Sync + 'static> Buf<T> {
    /// A view of `len` elements at byte `offset` of `owner`. When the bytes are not aligned
    /// for `T` (a safetensors writer is free to do that), they are copied to an aligned buffer.
    pub fn new(owner: Arc<dyn Storage>, offset: usize, len: usize) -> Result<Self>
    where
        T: Default,
    {
        let size = std::mem::size_of::<T>();
        let bytes = owner.bytes();
        let Some(end) = len.checked_mul(size).and_then(|n| n.checked_add(offset)) else {
            bail!("tensor size overflows");
        };
        if end > bytes.len() {
            bail!("tensor bytes {offset}..{end} lie past the end of the data ({} bytes): the file is truncated", bytes.len());
        }
        let ptr = bytes[offset..].as_ptr();
        if (ptr as usize) % std::mem::align_of::<T>() == 0 {
            return Ok(Buf { ptr: ptr as *const T, len, owner });
        }
        Ok(Buf::from_vec(copy_into_huge_pages(&bytes[offset..end])))
    }

    pub fn from_vec(values: Vec<T>) -> Self {
        let len = values.len();
        let storage = Arc::new(HeapStorage(values));
        let ptr = storage.0.as_ptr();
        Buf { owner: storage, ptr, len }
    }

    /// The same values in memory of the process's own, in 2 MB pages, when they are a file's
    /// pages now (whose pages the copy then gives back); else the same buffer.
    pub fn in_huge_pages(&self) -> Buf<T>
    where
        T: Default,
    {
        if !self.owner.is_file() {
            return self.clone();
        }
        let (offset, size) = (self.ptr as usize - self.owner.bytes().as_ptr() as usize, std::mem::size_of_val(self.as_slice()));
        let copy = copy_into_huge_pages(&self.owner.bytes()[offset..offset + size]);
        self.owner.release(offset, size);
        Buf::from_vec(copy)
    }

    /// Whether the values are a file's pages (a memory map).
    pub fn is_file(&self) -> bool {
        self.owner.is_file()
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr/len were checked against the owner's bytes, which the Arc keeps alive.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A tensor as found in a checkpoint: name, dtype, shape and its bytes.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub storage: Arc<dyn Storage>,
    pub offset: usize,
}

impl Tensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// All values as f32 (only for small tensors: norms, biases, conv taps).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let n = self.numel();
        Ok(match self.dtype {
            DType::F32 => Buf::<f32>::new(self.storage.clone(), self.offset, n)?.as_slice().to_vec(),
            DType::BF16 => {
                Buf::<u16>::new(self.storage.clone(), self.offset, n)?.as_slice().iter().map(|&b| bf16_to_f32(b)).collect()
            }
            DType::F16 => {
                Buf::<u16>::new(self.storage.clone(), self.offset, n)?.as_slice().iter().map(|&b| f16_to_f32(b)).collect()
            }
            DType::I8 => bail!("tensor {} is int8; checkpoints hold bf16, f16 or f32", self.name),
            DType::Blocks(f) => {
                if !n.is_multiple_of(f.elements()) {
                    bail!("tensor {} has {n} values, not a whole number of {f} blocks of {}", self.name, f.elements());
                }
                let bytes = self.block_bytes(f, n)?;
                let mut out = vec![0f32; n];
                blocks::dequantize(f, bytes, &mut out);
                out
            }
        })
    }

    /// The bytes of `n` values of block format `f` at the tensor's offset.
    fn block_bytes(&self, f: BlockFormat, n: usize) -> Result<&[u8]> {
        let (start, len) = (self.offset, f.bytes_of(n));
        match self.storage.bytes().get(start..start.saturating_add(len)) {
            Some(b) => Ok(b),
            None => bail!("tensor {}: bytes {start}..{} lie past the end of the data ({} bytes): the file is truncated", self.name, start.saturating_add(len), self.storage.bytes().len()),
        }
    }

    /// The index of its first value that is NaN or infinite (None: every value is finite).
    /// A checkpoint damaged that way would load without a word and generate one token forever.
    pub fn first_non_finite(&self) -> Result<Option<usize>> {
        let n = self.numel();
        Ok(match self.dtype {
            DType::F32 => first_where(Buf::<u32>::new(self.storage.clone(), self.offset, n)?.as_slice(), |b| b & 0x7F80_0000 == 0x7F80_0000),
            DType::BF16 => first_where(Buf::<u16>::new(self.storage.clone(), self.offset, n)?.as_slice(), |b| b & 0x7F80 == 0x7F80),
            DType::F16 => first_where(Buf::<u16>::new(self.storage.clone(), self.offset, n)?.as_slice(), |b| b & 0x7C00 == 0x7C00),
            DType::I8 => None,
            // A block's values are finite where its f16 scales are.
            DType::Blocks(f) => {
                let bytes = self.block_bytes(f, n)?;
                bytes.chunks_exact(f.bytes()).position(|b| blocks::scale_offsets(f).iter().any(|&at| u16::from_le_bytes([b[at], b[at + 1]]) & 0x7C00 == 0x7C00)).map(|b| b * f.elements())
            }
        })
    }
}

/// The first index of `values` where `bad` holds (every exponent bit set: NaN or infinity),
/// large slices split over the machine's cores; each part is tested in blocks without an early
/// exit, which the compiler vectorizes, then searched in the block that holds one.
fn first_where<T: Copy + Sync>(values: &[T], bad: impl Fn(T) -> bool + Sync) -> Option<usize> {
    const BLOCK: usize = 4096;
    let scan = |part: &[T]| -> Option<usize> {
        part.chunks(BLOCK).enumerate().find(|(_, b)| b.iter().fold(false, |any, &x| any | bad(x))).and_then(|(i, b)| b.iter().position(|&x| bad(x)).map(|j| i * BLOCK + j))
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(16);
    if values.len() < (1 << 22) || threads == 1 {
        return scan(values);
    }
    let part = values.len().div_ceil(threads);
    std::thread::scope(|s| {
        let scans: Vec<_> = values.chunks(part).enumerate().map(|(i, p)| (i, s.spawn(move || scan(p)))).collect();
        scans.into_iter().filter_map(|(i, h)| h.join().ok().flatten().map(|j| i * part + j)).min()
    })
}

/// A weight matrix `[rows, cols]` in PyTorch layout (`rows` = output features), row-major,
/// in its stored dtype.
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

#[derive(Clone)]
pub enum WeightData {
    Bf16(Buf<u16>),
    F16(Buf<u16>),
    F32(Buf<f32>),
    /// `value = q · scales[row]`; `sums[row] = Σ q` (the int8 GEMV's correction term).
    Int8 { q: Buf<i8>, scales: Buf<f32>, sums: Buf<i32> },
    /// Rows of `cols / format.elements()` blocks each, one row after another.
    Blocks { format: BlockFormat, data: Buf<u8> },
}

impl Matrix {
    /// This matrix with its weights in 2 MB pages (`Buf::in_huge_pages`).
    pub fn in_huge_pages(&self) -> Matrix {
        let data = match &self.data {
            WeightData::Bf16(b) => WeightData::Bf16(b.in_huge_pages()),
            WeightData::F16(b) => WeightData::F16(b.in_huge_pages()),
            WeightData::F32(b) => WeightData::F32(b.in_huge_pages()),
            WeightData::Int8 { q, scales, sums } => WeightData::Int8 { q: q.in_huge_pages(), scales: scales.clone(), sums: sums.clone() },
            WeightData::Blocks { format, data } => WeightData::Blocks { format: *format, data: data.in_huge_pages() },
        };
        Matrix { rows: self.rows, cols: self.cols, data }
    }

    pub fn from_tensor(t: &Tensor) -> Result<Matrix> {
        let (rows, cols) = match t.shape[..] {
            [r, c] => (r, c),
            _ => bail!("tensor {} has shape {:?}, expected a matrix", t.name, t.shape),
        };
        let n = rows * cols;
        let data = match t.dtype {
            DType::BF16 => WeightData::Bf16(Buf::new(t.storage.clone(), t.offset, n)?),
            DType::F16 => WeightData::F16(Buf::new(t.storage.clone(), t.offset, n)?),
            DType::F32 => WeightData::F32(Buf::new(t.storage.clone(), t.offset, n)?),
            DType::I8 => bail!("tensor {} is int8; checkpoints hold bf16, f16 or f32", t.name),
            DType::Blocks(format) => {
                if !cols.is_multiple_of(format.elements()) {
                    bail!("tensor {} has rows of {cols} values, not a whole number of {format} blocks of {}", t.name, format.elements());
                }
                WeightData::Blocks { format, data: Buf::new(t.storage.clone(), t.offset, format.bytes_of(n))? }
            }
        };
        Ok(Matrix { rows, cols, data })
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            WeightData::Bf16(_) => DType::BF16,
            WeightData::F16(_) => DType::F16,
            WeightData::F32(_) => DType::F32,
            WeightData::Int8 { .. } => DType::I8,
            WeightData::Blocks { format, .. } => DType::Blocks(format),
        }
    }

    /// Bytes this matrix occupies (what a GEMV over it must stream from memory).
    pub fn bytes(&self) -> usize {
        let per_row = if let WeightData::Int8 { .. } = self.data { 8 } else { 0 };
        self.rows * self.row_bytes() + self.rows * per_row
    }

    /// Bytes of one row's weights (their scales included for a block format; without the
    /// per-row scale and sum of int8).
    pub fn row_bytes(&self) -> usize {
        self.dtype().bytes_of(self.cols)
    }

    /// The first weight's address (which matrices share storage: a tied LM head).
    pub fn data_ptr(&self) -> *const u8 {
        match &self.data {
            WeightData::Bf16(b) | WeightData::F16(b) => b.as_slice().as_ptr() as *const u8,
            WeightData::F32(b) => b.as_slice().as_ptr() as *const u8,
            WeightData::Int8 { q, .. } => q.as_slice().as_ptr() as *const u8,
            WeightData::Blocks { data, .. } => data.as_slice().as_ptr(),
        }
    }

    /// Row `r` converted to f32 into `out` (embedding lookup).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            WeightData::Bf16(b) => {
                for (o, &v) in out.iter_mut().zip(&b.as_slice()[r * c..(r + 1) * c]) {
                    *o = bf16_to_f32(v);
                }
            }
            WeightData::F16(b) => {
                for (o, &v) in out.iter_mut().zip(&b.as_slice()[r * c..(r + 1) * c]) {
                    *o = f16_to_f32(v);
                }
            }
            WeightData::F32(b) => out.copy_from_slice(&b.as_slice()[r * c..(r + 1) * c]),
            WeightData::Int8 { q, scales, .. } => {
                let s = scales.as_slice()[r];
                for (o, &v) in out.iter_mut().zip(&q.as_slice()[r * c..(r + 1) * c]) {
                    *o = v as f32 * s;
                }
            }
            WeightData::Blocks { format, data } => {
                let rb = format.bytes_of(c);
                blocks::dequantize(*format, &data.as_slice()[r * rb..(r + 1) * rb], &mut out[..c]);
            }
        }
    }
}

#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Round-to-nearest-even f32 -> bf16 (what PyTorch's `.to(torch.bfloat16)` does).
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file's values copied out (in pieces on several cores when large) are the same values,
    /// no longer a file's pages; a buffer of the process's own is left as it is; values stored
    /// unaligned for their type go through the same copy when viewed.
    #[test]
    fn a_files_values_copied_into_huge_pages_are_the_same() {
        let path = std::env::temp_dir().join(format!("tandem-huge-pages-{}.bin", std::process::id()));
        let values: Vec<u16> = (0..3_000_001u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 16) as u16).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let file = [&[0u8; 6][..], &bytes].concat();
        std::fs::write(&path, &file).unwrap();
        let map: Arc<dyn Storage> = Arc::new(unsafe { memmap2::Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap());
        let _ = std::fs::remove_file(&path);
        let in_file = Buf::<u16>::new(map, 6, values.len()).unwrap();
        assert!(in_file.is_file());
        let copied = in_file.in_huge_pages();
        assert!(!copied.is_file());
        assert!(copied.as_slice() == &values[..]);
        // The file's pages were given back, not lost: they read again from the file.
        assert!(in_file.as_slice() == &values[..]);
        let again = copied.in_huge_pages();
        assert_eq!(again.as_slice().as_ptr(), copied.as_slice().as_ptr());
        // Values a file stores unaligned for their type are copied the same way when viewed.
        let unaligned = Buf::<u16>::new(in_file.owner.clone(), 5, values.len() - 1).unwrap();
        assert!(!unaligned.is_file());
        let shifted: Vec<u16> = file[5..].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).take(values.len() - 1).collect();
        assert!(unaligned.as_slice() == &shifted[..]);
    }

    /// The buffer is zeros, and on Linux with transparent huge pages the kernel took the advice:
    /// the mapping that holds its whole 2 MB pages is eligible for them (`THPeligible: 1` in
    /// /proc/self/smaps). Whether 2 MB pages were free to back it is the kernel's affair.
    #[test]
    fn weight_buffers_ask_for_huge_pages() {
        let v = zeroed_in_huge_pages::<u16>(5 << 20);
        assert_eq!(v.len(), 5 << 20);
        assert!(v.iter().all(|&x| x == 0));
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !cfg!(target_os = "linux") || thp.is_empty() || thp.contains("[never]") {
            eprintln!("no transparent huge pages here ({}): only the zeros were checked", thp.trim());
            return;
        }
        let inside = (v.as_ptr() as usize).next_multiple_of(2 << 20);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut eligible = None;
        let mut in_vma = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-')).and_then(|(a, b)| Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?)));
            if let Some((a, b)) = range {
                in_vma = (a..b).contains(&inside);
            } else if in_vma {
                if let Some(flag) = line.strip_prefix("THPeligible:") {
                    eligible = Some(flag.trim().to_string());
                }
            }
        }
        assert_eq!(eligible.as_deref(), Some("1"), "the buffer's mapping is not eligible for huge pages (transparent_hugepage: {})", thp.trim());
    }

    #[test]
    fn the_first_non_finite_value_is_found_in_small_and_split_scans() {
        let bf16_bad = |b: u16| b & 0x7F80 == 0x7F80;
        // 1.0 in bf16 is 0x3F80; NaN 0x7FC0; -infinity 0xFF80.
        for n in [10, 5000, (1 << 22) + 12_345] {
            let mut v = vec![0x3F80u16; n];
            assert_eq!(first_where(&v, bf16_bad), None, "{n} finite values");
            // NaNs added one by one, each before the last: the plain search's answer each time.
            for at in [n - 1, n / 2, n / 3] {
                v[at] = 0x7FC0;
                assert_eq!(first_where(&v, bf16_bad), v.iter().position(|&b| bf16_bad(b)), "{n} values, NaN at {at}");
                assert_eq!(first_where(&v, bf16_bad), Some(at), "{n} values, NaN at {at}");
            }
            v.fill(0x3F80);
            v[n - 1] = 0xFF80;
            assert_eq!(first_where(&v, bf16_bad), Some(n - 1), "{n} values, -inf last");
        }
        // f32: the largest finite value passes, infinity does not.
        let f32_bad = |b: u32| b & 0x7F80_0000 == 0x7F80_0000;
        assert_eq!(first_where(&[f32::MAX.to_bits(), f32::MIN_POSITIVE.to_bits()], f32_bad), None);
        assert_eq!(first_where(&[1f32.to_bits(), f32::INFINITY.to_bits()], f32_bad), Some(1));
    }
}
