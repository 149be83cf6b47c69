//! Devices: MLX runs every op on its default device unless told otherwise.

use crate::ffi::bridge::{self, DeviceKind};
use crate::Result;

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU (MLX's CPU backend).
    Cpu,
    /// The GPU of MLX's Metal (macOS) or CUDA (Linux) backend.
    Gpu,
}

impl Device {
    fn kind(self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Gpu => DeviceKind::Gpu,
        }
    }

    /// Whether this MLX build can run on the device (a GPU needs the Metal or CUDA backend).
    pub fn is_available(self) -> Result<bool> {
        Ok(bridge::device_available(self.kind())?)
    }

    /// Total memory of the device as MLX's backend reports it; `None` when it does not report
    /// one (the CPU backend), in which case callers use the system's memory.
    pub fn memory_bytes(self) -> Result<Option<usize>> {
        let bytes = bridge::device_memory_bytes(self.kind())?;
        Ok((bytes > 0).then_some(bytes))
    }

    /// The lower-case name (`"cpu"`, `"gpu"`), as `Display` prints it.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The device new ops run on. MLX picks the GPU when its build has one, else the CPU.
pub fn default_device() -> Result<Device> {
    Ok(match bridge::default_device_kind()? {
        DeviceKind::Gpu => Device::Gpu,
        _ => Device::Cpu,
    })
}

/// Makes `device` the default for ops created afterwards on this thread's default stream.
pub fn set_default_device(device: Device) -> Result<()> {
    if !device.is_available()? {
        return Err(crate::Error::Invalid(format!(
            "device {device} is not available in this MLX build"
        )));
    }
    Ok(bridge::set_default_device_kind(device.kind())?)
}
