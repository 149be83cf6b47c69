//! Element types.

pub use crate::ffi::bridge::Dtype;

impl Dtype {
    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            Dtype::Bool | Dtype::Uint8 | Dtype::Int8 => 1,
            Dtype::Uint16 | Dtype::Int16 | Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Uint32 | Dtype::Int32 | Dtype::Float32 => 4,
            Dtype::Uint64 | Dtype::Int64 | Dtype::Float64 | Dtype::Complex64 => 8,
            _ => 0,
        }
    }

    /// Whether the dtype is a real floating-point type (f16, bf16, f32, f64).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32 | Dtype::Float64
        )
    }

    /// The lower-case name used by NumPy, MLX and `config.json` (`"bfloat16"`, `"int32"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::Uint8 => "uint8",
            Dtype::Uint16 => "uint16",
            Dtype::Uint32 => "uint32",
            Dtype::Uint64 => "uint64",
            Dtype::Int8 => "int8",
            Dtype::Int16 => "int16",
            Dtype::Int32 => "int32",
            Dtype::Int64 => "int64",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Float32 => "float32",
            Dtype::Float64 => "float64",
            Dtype::Complex64 => "complex64",
            _ => "unknown",
        }
    }

    /// Parses the names `config.json` files use (`torch_dtype`/`dtype`), with or without a
    /// `torch.` prefix.
    pub fn from_name(name: &str) -> Option<Dtype> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        Some(match name {
            "bool" => Dtype::Bool,
            "uint8" => Dtype::Uint8,
            "uint16" => Dtype::Uint16,
            "uint32" => Dtype::Uint32,
            "uint64" => Dtype::Uint64,
            "int8" => Dtype::Int8,
            "int16" => Dtype::Int16,
            "int32" => Dtype::Int32,
            "int64" => Dtype::Int64,
            "float16" | "half" => Dtype::Float16,
            "bfloat16" => Dtype::Bfloat16,
            "float32" | "float" => Dtype::Float32,
            "float64" | "double" => Dtype::Float64,
            "complex64" => Dtype::Complex64,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
