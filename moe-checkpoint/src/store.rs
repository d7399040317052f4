//! The checkpoint's tensors: `model.safetensors.index.json` (or one `model.safetensors`), each
//! shard memory-mapped once and its header parsed by the safetensors crate, tensors looked up
//! by name with their dtype and shape checked before a byte is read.

use crate::error::{CheckpointError, Result};
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One tensor of a shard (dtype and shape already checked): its name and little-endian bytes,
/// borrowed from the mapping.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tensor<'a> {
    pub name: &'a str,
    pub data: &'a [u8],
}

impl Tensor<'_> {
    pub fn u32_at(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.data[4 * i..4 * i + 4].try_into().expect("4 bytes"))
    }
    pub fn u16_at(&self, i: usize) -> u16 {
        u16::from_le_bytes([self.data[2 * i], self.data[2 * i + 1]])
    }
}

/// A shard: its mapping and parsed header (read on first use).
struct Shard {
    path: PathBuf,
    map: OnceLock<(Mmap, usize, Metadata)>,
}

/// The tensors of a checkpoint directory.
pub(crate) struct Store {
    /// Tensor name -> index into `shards`; `None`: a single file holds every tensor.
    index: Option<HashMap<String, usize>>,
    shards: Vec<Shard>,
}

impl Store {
    /// The shards named by `model.safetensors.index.json`, else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Store> {
        let index_path = dir.join("model.safetensors.index.json");
        if !index_path.exists() {
            let path = dir.join("model.safetensors");
            return Ok(Store { index: None, shards: vec![Shard { path, map: OnceLock::new() }] });
        }
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let text =
            std::fs::read(&index_path).map_err(|source| CheckpointError::Io { path: index_path.clone(), source })?;
        let index: Index =
            serde_json::from_slice(&text).map_err(|source| CheckpointError::Json { path: index_path, source })?;
        let mut files: Vec<String> = index.weight_map.values().cloned().collect();
        files.sort();
        files.dedup();
        let shards = files.iter().map(|f| Shard { path: dir.join(f), map: OnceLock::new() }).collect();
        let map = index
            .weight_map
            .into_iter()
            .map(|(name, file)| {
                let i = files.binary_search(&file).expect("every file was listed");
                (name, i)
            })
            .collect();
        Ok(Store { index: Some(map), shards })
    }

    /// The shard's mapping and header, mapped and parsed on first use (a failure is not kept:
    /// the next call tries again and reports it again).
    fn shard(&self, i: usize) -> Result<(&Mmap, usize, &Metadata)> {
        let s = &self.shards[i];
        if s.map.get().is_none() {
            let io = |source| CheckpointError::Io { path: s.path.clone(), source };
            let file = std::fs::File::open(&s.path).map_err(io)?;
            // SAFETY: the mapping is read-only; a checkpoint modified on disk while it is loaded
            // is the caller's business (as with every safetensors loader).
            let map = unsafe { Mmap::map(&file) }.map_err(io)?;
            let (n, meta) = SafeTensors::read_metadata(&map)
                .map_err(|source| CheckpointError::Corrupt { file: s.path.clone(), source })?;
            // Another thread may have got there first: either mapping is the same file.
            let _ = s.map.set((map, n, meta));
        }
        let (map, n, meta) = s.map.get().expect("set above");
        Ok((map, *n, meta))
    }

    /// Whether the checkpoint has the tensor (per the index, or the single file's header).
    pub fn contains(&self, name: &str) -> Result<bool> {
        match &self.index {
            Some(map) => Ok(map.contains_key(name)),
            None => Ok(self.shard(0)?.2.info(name).is_some()),
        }
    }

    /// The tensor's shard, header length and entry in the shard's header.
    fn locate(&self, name: &str) -> Result<(&Mmap, usize, &safetensors::tensor::TensorInfo)> {
        let i = match &self.index {
            Some(map) => *map.get(name).ok_or_else(|| CheckpointError::MissingTensor {
                tensor: name.to_string(),
                file: PathBuf::from("model.safetensors.index.json"),
            })?,
            None => 0,
        };
        let (map, n, meta) = self.shard(i)?;
        let info = meta.info(name).ok_or_else(|| CheckpointError::MissingTensor {
            tensor: name.to_string(),
            file: self.shards[i].path.clone(),
        })?;
        Ok((map, n, info))
    }

    /// The tensor's dtype as the file has it.
    pub fn dtype(&self, name: &str) -> Result<Dtype> {
        Ok(self.locate(name)?.2.dtype)
    }

    /// The tensor `name`, which must have one of `dtypes` and the shape `shape`.
    pub fn get<'a>(&'a self, name: &'a str, dtypes: &[Dtype], shape: &[usize]) -> Result<(Tensor<'a>, Dtype)> {
        let (map, n, info) = self.locate(name)?;
        if !dtypes.contains(&info.dtype) {
            return Err(dtype_error(name, dtypes, info.dtype));
        }
        if info.shape != shape {
            return Err(CheckpointError::Shape {
                tensor: name.to_string(),
                expected: shape.to_vec(),
                got: info.shape.clone(),
            });
        }
        // read_metadata checked that the offsets tile the data section exactly.
        let (s, e) = info.data_offsets;
        let data = &map[8 + n + s..8 + n + e];
        Ok((Tensor { name, data }, info.dtype))
    }

    /// A 1- or 2-D float tensor (bf16, f16 or f32) widened to f32 (exactly).
    pub fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (t, dtype) = self.get(name, &[Dtype::BF16, Dtype::F16, Dtype::F32], shape)?;
        Ok(match dtype {
            Dtype::BF16 => t.data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F16 => t.data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            _ => t.data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect(),
        })
    }
}

/// The error for a tensor of dtype `got` where one of `expected` was needed.
pub(crate) fn dtype_error(name: &str, expected: &[Dtype], got: Dtype) -> CheckpointError {
    let names: Vec<String> = expected.iter().map(|d| format!("{d:?}")).collect();
    CheckpointError::Dtype { tensor: name.to_string(), expected: names.join(" or "), got: format!("{got:?}") }
}
