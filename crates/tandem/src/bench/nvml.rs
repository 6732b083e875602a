//! A GPU as NVML (libnvidia-ml.so, part of the NVIDIA driver, loaded at run time like the rest
//! of CUDA) sees it: its energy counter (energy per token is the counter's difference over a
//! run divided by the run's tokens) and its memory in use (by every process on it).

use anyhow::{bail, Result};
use libloading::{Library, Symbol};

type Device = *mut std::ffi::c_void;

/// One GPU's NVML handle.
pub struct NvmlDevice {
    lib: Library,
    device: Device,
}

// SAFETY: NVML handles are thread-safe (NVML's documentation: all its calls are); the meter is
// read from one thread at a time anyway.
unsafe impl Send for NvmlDevice {}
unsafe impl Sync for NvmlDevice {}

impl NvmlDevice {
    /// The counter of the GPU at PCI address `pci_bus_id` ("00000000:65:00.0"); an error says
    /// why there is none (no NVML, or a GPU without an energy counter: before Volta).
    pub fn open(pci_bus_id: &str) -> Result<NvmlDevice> {
        // SAFETY: loading the driver's NVML library runs only its initialisers.
        let lib = unsafe { Library::new("libnvidia-ml.so.1").or_else(|_| Library::new("libnvidia-ml.so")) }.map_err(|e| anyhow::anyhow!("NVML (libnvidia-ml.so.1) not found: {e}"))?;
        // SAFETY: the symbols have these C signatures (nvml.h).
        unsafe {
            let init: Symbol<unsafe extern "C" fn() -> i32> = lib.get(b"nvmlInit_v2\0")?;
            let code = init();
            if code != 0 {
                bail!("nvmlInit failed (NVML error {code})");
            }
            let by_bus: Symbol<unsafe extern "C" fn(*const std::ffi::c_char, *mut Device) -> i32> = lib.get(b"nvmlDeviceGetHandleByPciBusId_v2\0")?;
            let id = std::ffi::CString::new(pci_bus_id)?;
            let mut device: Device = std::ptr::null_mut();
            let code = by_bus(id.as_ptr(), &mut device);
            if code != 0 {
                bail!("NVML has no GPU at PCI address {pci_bus_id} (NVML error {code})");
            }
            Ok(NvmlDevice { lib, device })
        }
    }

    /// Energy used by the GPU since the driver loaded, in millijoules.
    pub fn millijoules(&self) -> Result<u64> {
        let mut mj = 0u64;
        // SAFETY: as in `open`; `device` is the handle NVML gave.
        let code = unsafe {
            let f: Symbol<unsafe extern "C" fn(Device, *mut u64) -> i32> = self.lib.get(b"nvmlDeviceGetTotalEnergyConsumption\0")?;
            f(self.device, &mut mj)
        };
        match code {
            0 => Ok(mj),
            3 => bail!("this GPU has no energy counter (NVML: not supported; it needs Volta or newer)"),
            _ => bail!("reading the GPU's energy counter failed (NVML error {code})"),
        }
    }

    /// Bytes of the GPU's memory in use, by all processes.
    pub fn memory_used(&self) -> Result<u64> {
        // nvmlMemory_t: total, free, used.
        let mut info = [0u64; 3];
        // SAFETY: as in `open`; `info` has the layout of nvmlMemory_t.
        let code = unsafe {
            let f: Symbol<unsafe extern "C" fn(Device, *mut u64) -> i32> = self.lib.get(b"nvmlDeviceGetMemoryInfo\0")?;
            f(self.device, info.as_mut_ptr())
        };
        if code != 0 {
            bail!("reading the GPU's memory use failed (NVML error {code})");
        }
        Ok(info[2])
    }
}
