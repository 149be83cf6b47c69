//! Parsing a GGUF file (versions 2 and 3) over a memory map: header, metadata, tensor infos and
//! the aligned data section.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! u32 magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//! kv_count × (string key, u32 value_type, value)
//! tensor_count × (string name, u32 n_dims, n_dims × u64 ne, u32 ggml_type, u64 offset)
//! padding to `general.alignment` (default 32) | data section (tensor offsets are relative to it)
//! ```
//!
//! A string is a u64 byte length followed by UTF-8 bytes; an array is a u32 element type, a u64
//! count and the elements.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::types::GgmlType;
use super::GgufError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// GGUF type 0.
    U8(u8),
    /// GGUF type 1.
    I8(i8),
    /// GGUF type 2.
    U16(u16),
    /// GGUF type 3.
    I16(i16),
    /// GGUF type 4.
    U32(u32),
    /// GGUF type 5.
    I32(i32),
    /// GGUF type 6.
    F32(f32),
    /// GGUF type 7 (one byte, 0 or 1).
    Bool(bool),
    /// GGUF type 8: a length-prefixed UTF-8 string.
    String(String),
    /// GGUF type 9: values of one element type (token lists, merges, scores).
    Array(Vec<MetaValue>),
    /// GGUF type 10.
    U64(u64),
    /// GGUF type 11.
    I64(i64),
    /// GGUF type 12.
    F64(f64),
}

impl MetaValue {
    /// The GGUF name of the value's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "uint8",
            MetaValue::I8(_) => "int8",
            MetaValue::U16(_) => "uint16",
            MetaValue::I16(_) => "int16",
            MetaValue::U32(_) => "uint32",
            MetaValue::I32(_) => "int32",
            MetaValue::F32(_) => "float32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "uint64",
            MetaValue::I64(_) => "int64",
            MetaValue::F64(_) => "float64",
        }
    }

    /// An integer value of any width (`None` for other types or negative values).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A signed integer value of any width.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A floating-point value; `F32` is widened through its shortest decimal form, so that
    /// `1e-5f32` reads back as `1e-5` rather than `9.99999974737875e-6`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => format!("{v}").parse().ok(),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value of a `Bool`; `None` for other types.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value of a `String`; `None` for other types.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements of an `Array`; `None` for other types.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// A tensor's entry in the GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`, `token_embd.weight`, ...).
    pub name: String,
    /// GGUF dimension order: `ne[0]` is the fastest-varying (innermost) axis, the reverse of
    /// PyTorch's; a PyTorch `[out, in]` matrix has `ne = [in, out]`.
    pub ne: Vec<u64>,
    /// How the data is stored.
    pub ggml_type: GgmlType,
    /// Offset of the tensor's bytes from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Elements (saturating: [`GgufFile::open`] refuses tensors whose count overflows).
    pub fn numel(&self) -> u64 {
        self.ne.iter().fold(1u64, |a, d| a.saturating_mul(*d))
    }

    /// The shape in PyTorch (row-major, slowest axis first) order.
    pub fn torch_shape(&self) -> Vec<u64> {
        self.ne.iter().rev().copied().collect()
    }
}

/// An open GGUF file: parsed header over a memory map of the whole file.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

/// A bounds-checked little-endian cursor over the header bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, message: impl Into<String>) -> GgufError {
        GgufError::format(self.path, message)
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!(
                "truncated: {what} needs {n} bytes at offset {} but the file has {}",
                self.pos,
                self.bytes.len()
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must describe at least `min_item_bytes` per item of the remaining bytes, so
    /// that a corrupt count fails here instead of reserving terabytes.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_item_bytes as u64) > remaining {
            return Err(self.err(format!(
                "truncated or corrupt: {what} is {n} but only {remaining} bytes follow at offset {}",
                self.pos
            )));
        }
        usize::try_from(n).map_err(|_| self.err(format!("{what} {n} does not fit in memory")))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(&format!("length of {what}"), 1)?;
        let at = self.pos;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.err(format!("{what} at offset {at} is not UTF-8: {e}")))
    }

    fn value(&mut self, type_id: u32, what: &str, depth: u32) -> Result<MetaValue, GgufError> {
        Ok(match type_id {
            0 => MetaValue::U8(self.u8(what)?),
            1 => MetaValue::I8(self.u8(what)? as i8),
            2 => MetaValue::U16(self.u16(what)?),
            3 => MetaValue::I16(self.u16(what)? as i16),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(self.u32(what)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.err(format!("{what}: bool byte {b} is neither 0 nor 1"))),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth > 8 {
                    return Err(self.err(format!("{what}: arrays nested deeper than 8")));
                }
                let elem = self.u32(what)?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    t => {
                        return Err(self.err(format!("{what}: unknown array element type {t}")));
                    }
                };
                let n = self.count(&format!("element count of {what}"), min)?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.value(elem, &format!("{what}[{i}]"), depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(self.u64(what)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(what)?)),
            t => return Err(self.err(format!("{what}: unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses `path`; tensor data stay in the memory map until asked for.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| GgufError::io(&path, e))?;
        // SAFETY: the map is read-only; as with any memory map, a concurrent truncation of the
        // file by another process is outside what this reader can guard against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| GgufError::io(&path, e))?;
        Self::parse(path, map)
    }

    fn parse(path: PathBuf, map: memmap2::Mmap) -> Result<GgufFile, GgufError> {
        let mut c = Cursor {
            bytes: &map,
            pos: 0,
            path: &path,
        };
        let magic = c.array::<4>("magic")?;
        if &magic != MAGIC {
            return Err(c.err(format!(
                "not a GGUF file: magic is {magic:02x?}, expected \"GGUF\""
            )));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!(
                "GGUF version {version} is not supported (only 2 and 3)"
            )));
        }
        // A tensor info is at least 8 (name length) + 4 + 4 + 8 bytes; a KV at least 8 + 4 + 1.
        let tensor_count = c.count("tensor count", 24)?;
        let kv_count = c.count("metadata count", 13)?;

        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = c.string(&format!("metadata key #{i}"))?;
            let type_id = c.u32(&format!("type of metadata `{key}`"))?;
            let value = c.value(type_id, &format!("metadata `{key}`"), 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.err(format!("metadata key `{key}` appears twice")));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(c.err(format!(
                        "general.alignment must be a positive power of two, got {v:?}"
                    )))
                }
            },
        };

        let mut tensors = Vec::with_capacity(tensor_count);
        for i in 0..tensor_count {
            let name = c.string(&format!("name of tensor #{i}"))?;
            let n_dims = c.u32(&format!("rank of tensor `{name}`"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(GgufError::tensor(
                    &path,
                    &name,
                    format!("rank {n_dims} is outside 1..=4"),
                ));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(c.u64(&format!("dimensions of tensor `{name}`"))?);
            }
            let type_id = c.u32(&format!("type of tensor `{name}`"))?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownType {
                path: path.clone(),
                tensor: name.clone(),
                type_id,
            })?;
            let offset = c.u64(&format!("offset of tensor `{name}`"))?;
            if offset % alignment != 0 {
                return Err(GgufError::tensor(
                    &path,
                    &name,
                    format!("data offset {offset} is not a multiple of the alignment {alignment}"),
                ));
            }
            tensors.push(GgufTensorInfo {
                name,
                ne,
                ggml_type,
                offset,
            });
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let file = GgufFile {
            path,
            map,
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        };
        // Check every tensor's extent now, so that a truncated download fails at open.
        for t in &file.tensors {
            file.tensor_data(t)?;
        }
        Ok(file)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// Alignment of tensor data in bytes (`general.alignment`, 32 by default).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Byte offset of the data section in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
    /// Every metadata key-value pair, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }
    /// One metadata value (`general.architecture`, `llama.block_count`, ...).
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
    /// The tensor infos, in header order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }
    /// The info of the tensor named `name`, if any.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (still block-quantized) bytes of a tensor.
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> Result<&[u8], GgufError> {
        let numel = info
            .ne
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| GgufError::tensor(&self.path, &info.name, "element count overflows"))?;
        let block = info.ggml_type.block_size() as u64;
        if info.ne[0] % block != 0 {
            return Err(GgufError::tensor(
                &self.path,
                &info.name,
                format!(
                    "innermost dimension {} is not a multiple of the {} block size {block}",
                    info.ne[0],
                    info.ggml_type.name()
                ),
            ));
        }
        let nbytes = (numel / block)
            .checked_mul(info.ggml_type.type_size() as u64)
            .ok_or_else(|| GgufError::tensor(&self.path, &info.name, "byte size overflows"))?;
        let start = self.data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(nbytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.map.len() as u64 => {
                Ok(&self.map[s as usize..e as usize])
            }
            _ => Err(GgufError::tensor(
                &self.path,
                &info.name,
                format!(
                    "truncated: data [{} + {}, +{nbytes}) runs past the end of the file ({} bytes)",
                    self.data_offset,
                    info.offset,
                    self.map.len()
                ),
            )),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes GGUF v3 bytes: metadata `(key, type id, encoded value)` and tensors
    /// `(name, ne, type id, data)` laid out at `alignment`.
    pub(crate) fn build(
        kvs: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
        alignment: usize,
    ) -> Vec<u8> {
        let s = |v: &str| {
            let mut b = (v.len() as u64).to_le_bytes().to_vec();
            b.extend(v.as_bytes());
            b
        };
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (k, t, v) in kvs {
            out.extend(s(k));
            out.extend(t.to_le_bytes());
            out.extend(v);
        }
        let mut offset = 0usize;
        let mut data = Vec::new();
        for (name, ne, ty, bytes) in tensors {
            out.extend(s(name));
            out.extend((ne.len() as u32).to_le_bytes());
            for d in ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            data.extend(bytes);
            offset += bytes.len();
            let pad = offset.div_ceil(alignment) * alignment - offset;
            data.extend(vec![0u8; pad]);
            offset += pad;
        }
        out.resize(out.len().div_ceil(alignment) * alignment, 0);
        out.extend(data);
        out
    }

    pub(crate) fn string_value(v: &str) -> Vec<u8> {
        let mut b = (v.len() as u64).to_le_bytes().to_vec();
        b.extend(v.as_bytes());
        b
    }

    pub(crate) fn write(bytes: &[u8]) -> tempfile::NamedTempFile {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn reads_every_metadata_type_and_custom_alignment() {
        let mut arr = 8u32.to_le_bytes().to_vec(); // array of strings
        arr.extend(2u64.to_le_bytes());
        arr.extend(string_value("a b"));
        arr.extend(string_value("ĠĠ"));
        let mut nested = 9u32.to_le_bytes().to_vec(); // array of arrays of i16
        nested.extend(1u64.to_le_bytes());
        nested.extend(3u32.to_le_bytes());
        nested.extend(2u64.to_le_bytes());
        nested.extend((-2i16).to_le_bytes());
        nested.extend(7i16.to_le_bytes());
        let kvs = vec![
            ("general.alignment", 4, 64u32.to_le_bytes().to_vec()),
            ("u8", 0, vec![200]),
            ("i8", 1, vec![0xFF]),
            ("u16", 2, 513u16.to_le_bytes().to_vec()),
            ("i32", 5, (-5i32).to_le_bytes().to_vec()),
            ("f32", 6, 1e-5f32.to_le_bytes().to_vec()),
            ("bool", 7, vec![1]),
            ("str", 8, string_value("llama")),
            ("arr", 9, arr),
            ("nested", 9, nested),
            ("u64", 10, u64::MAX.to_le_bytes().to_vec()),
            ("i64", 11, (-9i64).to_le_bytes().to_vec()),
            ("f64", 12, 0.25f64.to_le_bytes().to_vec()),
        ];
        let tensors = vec![
            (
                "a",
                vec![3],
                0,
                [1f32, 2., 3.]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            ("b", vec![2, 1], 1, vec![0, 0x3C, 0, 0xC0]),
        ];
        let f = write(&build(&kvs, &tensors, 64));
        let g = GgufFile::open(f.path()).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 64);
        assert_eq!(g.data_offset() % 64, 0);
        assert_eq!(g.get("u8"), Some(&MetaValue::U8(200)));
        assert_eq!(g.get("i8"), Some(&MetaValue::I8(-1)));
        assert_eq!(g.get("u16").and_then(|v| v.as_u64()), Some(513));
        assert_eq!(g.get("i32").and_then(|v| v.as_i64()), Some(-5));
        assert_eq!(g.get("f32").and_then(|v| v.as_f64()), Some(1e-5));
        assert_eq!(g.get("bool").and_then(|v| v.as_bool()), Some(true));
        assert_eq!(g.get("str").and_then(|v| v.as_str()), Some("llama"));
        let arr = g.get("arr").and_then(|v| v.as_array()).unwrap();
        assert_eq!(arr[1].as_str(), Some("ĠĠ"));
        assert_eq!(
            g.get("nested"),
            Some(&MetaValue::Array(vec![MetaValue::Array(vec![
                MetaValue::I16(-2),
                MetaValue::I16(7)
            ])]))
        );
        assert_eq!(g.get("u64").and_then(|v| v.as_u64()), Some(u64::MAX));
        assert_eq!(g.get("i64").and_then(|v| v.as_i64()), Some(-9));
        assert_eq!(g.get("f64").and_then(|v| v.as_f64()), Some(0.25));
        let b = g.tensor("b").unwrap();
        assert_eq!(b.offset, 64);
        assert_eq!(b.torch_shape(), vec![1, 2]);
        assert_eq!(g.tensor_data(b).unwrap(), &[0, 0x3C, 0, 0xC0]);
    }

    fn err_of(bytes: &[u8]) -> String {
        let f = write(bytes);
        match GgufFile::open(f.path()) {
            Ok(_) => panic!("expected an error"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains(&f.path().display().to_string()), "{msg}");
                msg
            }
        }
    }

    #[test]
    fn errors_name_the_file_and_tensor() {
        let one = |ty: u32, data: Vec<u8>| {
            build(&[], &[("blk.0.attn_q.weight", vec![32, 2], ty, data)], 32)
        };
        let mut bad = one(0, vec![0; 256]);
        bad[0] = b'X';
        assert!(err_of(&bad).contains("not a GGUF file"));
        let mut v1 = one(0, vec![0; 256]);
        v1[4] = 1;
        assert!(err_of(&v1).contains("version 1"));
        // Q4_1 needs 2 blocks · 20 bytes; give it 30.
        let msg = err_of(&one(3, vec![0; 30]));
        assert!(
            msg.contains("blk.0.attn_q.weight") && msg.contains("truncated"),
            "{msg}"
        );
        let msg = err_of(&one(5, vec![0; 64]));
        assert!(
            msg.contains("blk.0.attn_q.weight") && msg.contains("type id 5"),
            "{msg}"
        );
        let full = one(0, vec![0; 256]);
        let msg = err_of(&full[..30]);
        assert!(msg.contains("truncated"), "{msg}");
        let bad_kv = build(&[("k", 13, vec![0])], &[], 32);
        assert!(err_of(&bad_kv).contains("unknown metadata value type 13"));
        let huge = build(&[("k", 8, u64::MAX.to_le_bytes().to_vec())], &[], 32);
        assert!(err_of(&huge).contains("length of metadata `k`"));
    }
}
