//! tandem's kernels compiled for the GPU at hand, and kept on disk. NVRTC compiles them at run
//! time to a CUBIN for the GPU's architecture (seconds); the CUBIN is then written to the kernel
//! cache, so that a later process with the same kernel source, architecture and NVRTC loads it
//! instead (milliseconds). The cache lives in `$TANDEM_CACHE_DIR` (`off` turns it off), else
//! `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`, under `kernels/`; a file that is damaged or
//! not what its name says is never loaded: it is compiled again and replaced.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use cudarc::nvrtc::{result as nvrtc, sys};

use crate::bridge::checksum::checksum;

/// How the kernels were had (for the start-up line and the tests).
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// Read from this cache file.
    Cached(PathBuf),
    /// Compiled now (and written to the cache file, where one could be written).
    Compiled { seconds: f64, cached_to: Option<PathBuf> },
}

/// The CUBIN of `source` for `arch` (such as `sm_90`), from the cache in `dir` where it holds
/// a good one, else compiled (and stored there).
pub fn kernels_for(source: &str, arch: &str, dir: Option<&Path>) -> Result<(Vec<u8>, Origin)> {
    let options = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
    let file = dir.map(|d| d.join(format!("{arch}-{:016x}.cubin", key(source, &options))));
    if let Some(file) = &file {
        match read(file) {
            Ok(Some(cubin)) => return Ok((cubin, Origin::Cached(file.clone()))),
            Ok(None) => {}
            Err(why) => eprintln!("kernel cache: {}: {why}; compiling the kernels again", file.display()),
        }
    }
    let start = std::time::Instant::now();
    let cubin = compile(source, &options)?;
    let seconds = start.elapsed().as_secs_f64();
    let cached_to = file.and_then(|f| match write(&f, &cubin) {
        Ok(()) => Some(f),
        Err(why) => {
            eprintln!("kernel cache: cannot write {} ({why}); the kernels will be compiled again next time", f.display());
            None
        }
    });
    Ok((cubin, Origin::Compiled { seconds, cached_to }))
}

/// Where the kernel cache lives for this process (None: turned off, or no home to put it in).
pub fn cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("TANDEM_CACHE_DIR") {
        Some(v) if v == "off" => return None,
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
            Some(v) => PathBuf::from(v).join("tandem"),
            None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".cache/tandem"),
        },
    };
    Some(base.join("kernels"))
}

/// What the compiled code depends on: the source, the options and the compiler's version.
fn key(source: &str, options: &[String]) -> u64 {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters; a failure leaves them 0 (the key is then still a key).
    let _ = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    let mut text = format!("nvrtc {major}.{minor}\0{}\0", options.join("\0")).into_bytes();
    text.extend_from_slice(source.as_bytes());
    checksum(&text)
}

/// A cache file: this magic, the CUBIN's length and checksum (little-endian u64s), the CUBIN.
const MAGIC: &[u8; 8] = b"TNDMCUB1";
const HEADER: usize = 24;

/// The CUBIN in `file`, None where there is no such file, an error naming what is wrong with it.
fn read(file: &Path) -> Result<Option<Vec<u8>>> {
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => bail!("cannot read it ({e})"),
    };
    Ok(Some(parse(&bytes)?.to_vec()))
}

fn parse(bytes: &[u8]) -> Result<&[u8]> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        bail!("not a tandem kernel cache file");
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let (len, sum) = (word(8), word(16));
    let body = &bytes[HEADER..];
    if body.len() as u64 != len {
        bail!("{} bytes of compiled kernels where the header says {len} (a truncated file?)", body.len());
    }
    if checksum(body) != sum {
        bail!("the compiled kernels do not match their checksum (a damaged file)");
    }
    Ok(body)
}

/// Writes `file` whole or not at all (a new file renamed over it), so that a reader never
/// sees half of one.
fn write(file: &Path, cubin: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut bytes = Vec::with_capacity(HEADER + cubin.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&checksum(cubin).to_le_bytes());
    bytes.extend_from_slice(cubin);
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, file).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// NVRTC: `source` to a CUBIN with `options`.
fn compile(source: &str, options: &[String]) -> Result<Vec<u8>> {
    let src = CString::new(source).expect("the kernel source has no NUL byte");
    let prog = nvrtc::create_program(&src, None).map_err(|e| anyhow::anyhow!("NVRTC cannot create a program: {e:?}"))?;
    // SAFETY: `prog` is a live program until it is destroyed at the end; the out-buffers are
    // sized by NVRTC's own size queries.
    let out = unsafe {
        let compiled = nvrtc::compile_program(prog, options).map_err(|e| {
            let log = nvrtc::get_program_log(prog).map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned()).unwrap_or_default();
            anyhow::anyhow!("compiling tandem's kernels ({}) failed: {e:?}\n{log}", options.join(" "))
        });
        let cubin = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| anyhow::anyhow!("NVRTC: the CUBIN's size: {e:?}"))?;
            let mut cubin = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result().map_err(|e| anyhow::anyhow!("NVRTC: the CUBIN: {e:?}"))?;
            Ok(cubin)
        });
        let _ = nvrtc::destroy_program(prog);
        cubin
    };
    if out.as_ref().is_ok_and(|c| c.is_empty()) {
        bail!("NVRTC returned no CUBIN for {}", options.join(" "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache file is read back exactly, and a file that is truncated, altered, of another
    /// kind or empty is refused with a reason, never returned.
    #[test]
    fn cache_files_round_trip_and_damaged_ones_are_refused() {
        let dir = std::env::temp_dir().join(format!("tandem-kernel-cache-{}", std::process::id()));
        let file = dir.join("sm_90-0123.cubin");
        let cubin: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        write(&file, &cubin).unwrap();
        assert_eq!(read(&file).unwrap().as_deref(), Some(&cubin[..]));
        assert!(read(&dir.join("absent.cubin")).unwrap().is_none());

        let good = std::fs::read(&file).unwrap();
        let mut flipped = good.clone();
        flipped[HEADER + 1234] ^= 4;
        let cases: [(&str, Vec<u8>, &str); 4] = [
            ("truncated", good[..good.len() - 10].to_vec(), "truncated"),
            ("altered", flipped, "checksum"),
            ("another kind", b"\x7fELF and so on, long enough".to_vec(), "not a tandem kernel cache file"),
            ("empty", vec![], "not a tandem kernel cache file"),
        ];
        for (what, bytes, says) in cases {
            std::fs::write(&file, &bytes).unwrap();
            let e = read(&file).unwrap_err().to_string();
            assert!(e.contains(says), "{what}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The cache directory follows TANDEM_CACHE_DIR, `off` turns it off.
    #[test]
    fn the_cache_directory_is_chosen_by_the_environment() {
        // Only this test touches these variables in this process.
        let saved = std::env::var_os("TANDEM_CACHE_DIR");
        // SAFETY: no other thread of the test binary reads TANDEM_CACHE_DIR.
        unsafe { std::env::set_var("TANDEM_CACHE_DIR", "/some/where") };
        assert_eq!(cache_dir(), Some(PathBuf::from("/some/where/kernels")));
        unsafe { std::env::set_var("TANDEM_CACHE_DIR", "off") };
        assert_eq!(cache_dir(), None);
        match saved {
            Some(v) => unsafe { std::env::set_var("TANDEM_CACHE_DIR", v) },
            None => unsafe { std::env::remove_var("TANDEM_CACHE_DIR") },
        }
    }
}
