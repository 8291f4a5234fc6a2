//! The dtype a service computes in, chosen from what the device does natively.
//!
//! bf16 halves memory traffic, which is what decoding and training are bound
//! by, but only where the hardware has bf16 arithmetic: CUDA GPUs from Ampere
//! on, and x86 CPUs with AVX512-BF16 or AMX. Elsewhere libtorch converts every
//! bf16 operand to f32 and back, so bf16 is both slower and less exact than
//! plain f32 (measured in `docs/policy-server.md`). `auto` therefore picks bf16
//! only on such devices and f32 otherwise, and says which it picked.

use std::fmt;
use std::str::FromStr;

use tch::{Device, Kind};

use crate::TorchError;

/// A compute dtype as configured (`--dtype auto|f32|bf16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DtypeSpec {
    /// bf16 where the device computes it natively, else f32.
    #[default]
    Auto,
    F32,
    Bf16,
}

impl FromStr for DtypeSpec {
    type Err = TorchError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "auto" => Ok(Self::Auto),
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            other => Err(TorchError::BadDtype(other.to_owned())),
        }
    }
}

impl fmt::Display for DtypeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        })
    }
}

/// A resolved dtype and the reason it was chosen, for the startup log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dtype {
    /// What tensors are converted to.
    pub kind: Kind,
    /// Why: "configured", or what the device does or lacks.
    pub reason: String,
}

impl DtypeSpec {
    /// The libtorch kind for computing on `device`.
    pub fn resolve(self, device: Device) -> Dtype {
        let configured = |kind| Dtype { kind, reason: "configured".to_owned() };
        match self {
            Self::F32 => configured(Kind::Float),
            Self::Bf16 => configured(Kind::BFloat16),
            Self::Auto => match device {
                // Every GPU Sleuth targets (A100, L40S, H100/H200) is sm_80 or
                // newer; libtorch does not expose the compute capability, so
                // older cards must be configured as f32 by hand.
                Device::Cuda(_) => Dtype { kind: Kind::BFloat16, reason: "CUDA device".to_owned() },
                _ => {
                    let features = CpuFeatures::detect();
                    let kind = if features.native_bf16() { Kind::BFloat16 } else { Kind::Float };
                    Dtype { kind, reason: format!("CPU: {features}") }
                }
            },
        }
    }
}

/// The CPU facts that decide whether bf16 is native, as libtorch will see them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub avx512f: bool,
    pub avx512_bf16: bool,
    pub amx_bf16: bool,
    /// `ATEN_CPU_CAPABILITY` when set: caps the kernels libtorch dispatches to
    /// (e.g. `avx2` keeps it off the AVX-512 paths even where the CPU has them).
    pub aten_cpu_capability: Option<String>,
    /// `ONEDNN_MAX_CPU_ISA` when set: the same cap for oneDNN's matmuls.
    pub onednn_max_cpu_isa: Option<String>,
}

impl CpuFeatures {
    /// Reads the CPU's flags (Linux `/proc/cpuinfo`; none elsewhere) and the
    /// environment variables that cap libtorch's kernels.
    pub fn detect() -> Self {
        let flags = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| info.lines().find(|l| l.starts_with("flags")).map(str::to_owned))
            .unwrap_or_default();
        Self::from_flags(
            &flags,
            std::env::var("ATEN_CPU_CAPABILITY").ok().filter(|v| !v.is_empty()),
            std::env::var("ONEDNN_MAX_CPU_ISA").ok().filter(|v| !v.is_empty()),
        )
    }

    /// From a `/proc/cpuinfo` flags line and the two capping variables.
    pub fn from_flags(flags: &str, aten_cpu_capability: Option<String>, onednn_max_cpu_isa: Option<String>) -> Self {
        let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
        Self {
            avx2: has("avx2"),
            avx512f: has("avx512f"),
            avx512_bf16: has("avx512_bf16"),
            amx_bf16: has("amx_bf16"),
            aten_cpu_capability,
            onednn_max_cpu_isa,
        }
    }

    /// Whether libtorch computes bf16 natively here: the CPU has AVX512-BF16
    /// or AMX and neither variable caps libtorch below AVX-512.
    pub fn native_bf16(&self) -> bool {
        // ATen's own kernels: `avx512` (or no cap) keeps its AVX-512 paths.
        let aten_ok = self.aten_cpu_capability.as_deref().is_none_or(|cap| cap.eq_ignore_ascii_case("avx512"));
        // oneDNN (the matmuls): only these levels include bf16 instructions.
        let onednn_ok = self.onednn_max_cpu_isa.as_deref().is_none_or(|cap| {
            let cap = cap.to_ascii_uppercase();
            cap == "ALL" || cap == "AVX512_CORE_BF16" || cap.starts_with("AVX512_CORE_AMX") || cap.starts_with("AVX10")
        });
        (self.avx512_bf16 || self.amx_bf16) && aten_ok && onednn_ok
    }
}

impl fmt::Display for CpuFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        write!(
            f,
            "avx2 {}, avx512f {}, avx512_bf16 {}, amx_bf16 {}",
            yes_no(self.avx2),
            yes_no(self.avx512f),
            yes_no(self.avx512_bf16),
            yes_no(self.amx_bf16)
        )?;
        if let Some(cap) = &self.aten_cpu_capability {
            write!(f, ", ATEN_CPU_CAPABILITY={cap}")?;
        }
        if let Some(cap) = &self.onednn_max_cpu_isa {
            write!(f, ", ONEDNN_MAX_CPU_ISA={cap}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAPPHIRE_RAPIDS: &str = "flags : fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile";
    const ZEN2: &str = "flags : fpu sse4_2 avx avx2 fma";

    #[test]
    fn parses_dtype_strings() {
        assert_eq!("auto".parse::<DtypeSpec>().unwrap(), DtypeSpec::Auto);
        assert_eq!("f32".parse::<DtypeSpec>().unwrap(), DtypeSpec::F32);
        assert_eq!("bfloat16".parse::<DtypeSpec>().unwrap(), DtypeSpec::Bf16);
        let error = "fp16".parse::<DtypeSpec>().unwrap_err().to_string();
        assert!(error.contains("\"fp16\"") && error.contains("auto"), "{error}");
    }

    #[test]
    fn bf16_is_native_only_with_avx512_bf16_or_amx() {
        assert!(CpuFeatures::from_flags(SAPPHIRE_RAPIDS, None, None).native_bf16());
        assert!(CpuFeatures::from_flags("flags : avx2 avx512f avx512_bf16", None, None).native_bf16());
        assert!(!CpuFeatures::from_flags("flags : avx2 avx512f", None, None).native_bf16());
        assert!(!CpuFeatures::from_flags(ZEN2, None, None).native_bf16());
    }

    #[test]
    fn capping_libtorch_below_avx512_turns_native_bf16_off() {
        let native = |aten: Option<&str>, onednn: Option<&str>| {
            CpuFeatures::from_flags(SAPPHIRE_RAPIDS, aten.map(Into::into), onednn.map(Into::into)).native_bf16()
        };
        assert!(!native(Some("avx2"), None));
        assert!(!native(None, Some("AVX2")));
        assert!(native(Some("avx512"), Some("AVX512_CORE_AMX")));
        assert!(!native(None, Some("AVX512_CORE")));
    }

    #[test]
    fn explicit_dtypes_are_kept_and_auto_says_why() {
        assert_eq!(DtypeSpec::Bf16.resolve(Device::Cpu).kind, Kind::BFloat16);
        assert_eq!(DtypeSpec::F32.resolve(Device::Cuda(0)).kind, Kind::Float);
        let auto = DtypeSpec::Auto.resolve(Device::Cpu);
        let native = CpuFeatures::detect().native_bf16();
        assert_eq!(auto.kind, if native { Kind::BFloat16 } else { Kind::Float });
        assert!(auto.reason.starts_with("CPU: avx2"), "{}", auto.reason);
    }
}
