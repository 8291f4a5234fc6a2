//! libtorch device selection shared by the services that run tensors
//! (policy server, learner, and the tool gateway's embedding model).
//!
//! Device strings come from configuration (`--device auto|cpu|cuda|cuda:N`)
//! and are checked here once, with errors that say what is available, instead
//! of each service failing later inside libtorch.

mod args;
mod dtype;

pub use args::ModelArgs;
pub use dtype::{CpuFeatures, Dtype, DtypeSpec};

use std::fmt;
use std::str::FromStr;

use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum TorchError {
    #[error("device must be auto, cpu, cuda or cuda:N, got {0:?}")]
    BadDevice(String),
    #[error("dtype must be auto, f32 or bf16, got {0:?}")]
    BadDtype(String),
    #[error("device {requested} requested but {available}")]
    Unavailable { requested: DeviceSpec, available: String },
    #[error("libtorch check on {device:?} failed: {message}")]
    Check { device: Device, message: String },
}

impl sleuth_kit::ServiceError for TorchError {
    fn kind(&self) -> sleuth_kit::ErrorKind {
        match self {
            TorchError::BadDevice(_) | TorchError::BadDtype(_) | TorchError::Unavailable { .. } => {
                sleuth_kit::ErrorKind::InvalidArgument
            }
            TorchError::Check { .. } => sleuth_kit::ErrorKind::Internal,
        }
    }
}

/// A device as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The first CUDA device when there is one, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = TorchError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|index| index.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| TorchError::BadDevice(other.to_owned())),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}

impl DeviceSpec {
    /// The libtorch device, checked against what this machine has.
    pub fn resolve(self) -> Result<Device, TorchError> {
        let cuda_devices = cuda_device_count();
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Auto if cuda_devices > 0 => Ok(Device::Cuda(0)),
            Self::Auto => Ok(Device::Cpu),
            Self::Cuda(index) if index < cuda_devices => Ok(Device::Cuda(index)),
            Self::Cuda(_) => Err(TorchError::Unavailable {
                requested: self,
                available: match cuda_devices {
                    0 => "libtorch sees no CUDA device".to_owned(),
                    n => format!("libtorch sees only {n} CUDA device(s)"),
                },
            }),
        }
    }
}

/// CUDA devices libtorch can use (0 on CPU-only machines and builds).
pub fn cuda_device_count() -> usize {
    if tch::Cuda::is_available() { usize::try_from(tch::Cuda::device_count()).unwrap_or(0) } else { 0 }
}

/// Human-readable name of a device, as reported in model info ("cpu", "cuda:0").
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(index) => format!("cuda:{index}"),
        _ => "cpu".to_owned(),
    }
}

/// Runs a small matrix product on `device` and checks the result, proving
/// that libtorch loaded and the device computes. Used as a readiness probe.
pub fn check_device(device: Device) -> Result<(), TorchError> {
    let fail = |message: String| TorchError::Check { device, message };
    let run = || -> Result<Vec<f32>, tch::TchError> {
        let a = Tensor::f_from_slice(&[1f32, 2., 3., 4., 5., 6.])?.f_reshape([2, 3])?.f_to_device(device)?;
        let product = a.f_matmul(&a.f_transpose(0, 1)?)?.f_to_device(Device::Cpu)?.f_to_kind(Kind::Float)?;
        Vec::<f32>::try_from(product.f_flatten(0, -1)?)
    };
    let product = run().map_err(|error| fail(error.to_string()))?;
    // [[1,2,3],[4,5,6]] x its transpose.
    if product == [14., 32., 32., 77.] { Ok(()) } else { Err(fail(format!("wrong matmul result {product:?}"))) }
}

/// Readiness probe: [`check_device`] on `device`, off the async runtime
/// (libtorch calls block, and the first one loads kernels).
pub fn device_probe(device: Device) -> std::sync::Arc<dyn sleuth_kit::Probe> {
    use futures::FutureExt;
    sleuth_kit::health::probe_fn("libtorch", move || {
        async move {
            match tokio::task::spawn_blocking(move || check_device(device)).await {
                Ok(result) => result.map_err(|error| error.to_string()),
                Err(join) => Err(format!("libtorch check panicked: {join}")),
            }
        }
        .boxed()
    })
}

/// Sets libtorch's intra-op threads for the calling thread (OpenMP keeps the
/// count per thread, so call this on the thread that runs the tensors):
/// `requested` when above 0; else `OMP_NUM_THREADS` when set (libtorch read
/// it at start); else the CPUs this process may use, which
/// `available_parallelism` takes from a pod's CPU limit where OpenMP would
/// count the node's cores.
pub fn set_intra_op_threads(requested: usize) {
    let threads = match requested {
        0 if std::env::var_os("OMP_NUM_THREADS").is_some() => None,
        0 => std::thread::available_parallelism().ok().map(|cpus| cpus.get()),
        threads => Some(threads),
    };
    if let Some(threads) = threads {
        tch::set_num_threads(threads as i32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_strings() {
        assert_eq!("auto".parse::<DeviceSpec>().unwrap(), DeviceSpec::Auto);
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        let error = "gpu".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(error.contains("\"gpu\""), "{error}");
    }

    #[test]
    fn libtorch_computes_on_the_cpu() {
        check_device(Device::Cpu).unwrap();
    }

    #[test]
    fn missing_cuda_device_is_a_clear_error() {
        let beyond = DeviceSpec::Cuda(cuda_device_count());
        let error = beyond.resolve().unwrap_err().to_string();
        assert!(error.contains(&beyond.to_string()) && error.contains("CUDA device"), "{error}");
    }

    #[test]
    fn auto_picks_a_working_device() {
        check_device(DeviceSpec::Auto.resolve().unwrap()).unwrap();
    }
}
