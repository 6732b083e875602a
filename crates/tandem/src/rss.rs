//! This process's peak resident memory, for the reports of `generate` and `bench`.

/// Start measuring this process's peak resident memory afresh (VmHWM becomes the current RSS);
/// false where the kernel does not allow it (Linux before 4.0, or no /proc).
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Peak resident memory of this process so far (VmHWM), in bytes; None where /proc is absent.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
