//! Which physical GPU a child process (a TP rank, a device probe) gets.
//!
//! MLX 0.32.4 drives one GPU per process, so every rank runs as its own
//! process that sees exactly one GPU through `CUDA_VISIBLE_DEVICES`. The
//! entry it gets is picked from the parent's own view: if the parent runs
//! with `CUDA_VISIBLE_DEVICES=2,3` its GPU 0 is physical entry `2`, so the
//! child of entry 0 gets `CUDA_VISIBLE_DEVICES=2`. Entries are passed on as
//! written (indices, `GPU-…` UUIDs or `MIG-…` ids).
//!
//! Indices depend on the enumeration order, so children also get
//! `CUDA_DEVICE_ORDER`: the inherited value if set, else `PCI_BUS_ID` (the
//! order `nvidia-smi` uses). The CLI sets `PCI_BUS_ID` for its own process
//! too, before MLX starts CUDA, so the parent's GPU `i` is the child's GPU.

/// Variables that decide which GPUs a CUDA process sees.
pub const VISIBLE_DEVICES_VAR: &str = "CUDA_VISIBLE_DEVICES";
pub const DEVICE_ORDER_VAR: &str = "CUDA_DEVICE_ORDER";
/// The order children get when none is inherited.
pub const DEFAULT_DEVICE_ORDER: &str = "PCI_BUS_ID";

/// A GPU the parent cannot place a child on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("GPU {entry} does not exist: CUDA_VISIBLE_DEVICES={inherited:?} lists {count} GPU(s)")]
    NoSuchEntry {
        entry: usize,
        count: usize,
        inherited: String,
    },
}

/// The entries of a `CUDA_VISIBLE_DEVICES` value, trimmed; empty ones dropped.
pub fn parse_visible_devices(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// The environment that gives a child the parent's GPU `entry` (pure: the
/// inherited `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` are arguments).
pub fn gpu_env_for(
    entry: usize,
    inherited_visible: Option<&str>,
    inherited_order: Option<&str>,
) -> Result<Vec<(String, String)>, PlacementError> {
    let device = match inherited_visible {
        Some(value) => {
            let list = parse_visible_devices(value);
            list.get(entry)
                .cloned()
                .ok_or_else(|| PlacementError::NoSuchEntry {
                    entry,
                    count: list.len(),
                    inherited: value.to_string(),
                })?
        }
        None => entry.to_string(),
    };
    let order = inherited_order
        .filter(|o| !o.trim().is_empty())
        .unwrap_or(DEFAULT_DEVICE_ORDER);
    Ok(vec![
        (VISIBLE_DEVICES_VAR.to_string(), device),
        (DEVICE_ORDER_VAR.to_string(), order.to_string()),
    ])
}

/// The environment pairs for the child that runs on this process's GPU
/// `rank_entry`, read against this process's `CUDA_VISIBLE_DEVICES` and
/// `CUDA_DEVICE_ORDER`. Set them on the child's `Command`.
pub fn visible_devices_for(rank_entry: usize) -> Result<Vec<(String, String)>, PlacementError> {
    let visible = std::env::var(VISIBLE_DEVICES_VAR).ok();
    let order = std::env::var(DEVICE_ORDER_VAR).ok();
    gpu_env_for(rank_entry, visible.as_deref(), order.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(v: &str, o: &str) -> Vec<(String, String)> {
        vec![
            (VISIBLE_DEVICES_VAR.into(), v.into()),
            (DEVICE_ORDER_VAR.into(), o.into()),
        ]
    }

    #[test]
    fn no_inherited_list_uses_the_index() {
        assert_eq!(
            gpu_env_for(0, None, None).unwrap(),
            pairs("0", "PCI_BUS_ID")
        );
        assert_eq!(
            gpu_env_for(5, None, None).unwrap(),
            pairs("5", "PCI_BUS_ID")
        );
    }

    #[test]
    fn inherited_indices_are_mapped() {
        let env = gpu_env_for(1, Some("4,6, 7"), None).unwrap();
        assert_eq!(env, pairs("6", "PCI_BUS_ID"));
        assert_eq!(
            gpu_env_for(2, Some("4,6, 7"), None).unwrap(),
            pairs("7", "PCI_BUS_ID")
        );
    }

    #[test]
    fn inherited_uuids_pass_through() {
        let list =
            "GPU-8c4a7b2e-1111-2222-3333-444455556666,MIG-0f1e2d3c-aaaa-bbbb-cccc-ddddeeeeffff";
        assert_eq!(
            gpu_env_for(0, Some(list), None).unwrap(),
            pairs("GPU-8c4a7b2e-1111-2222-3333-444455556666", "PCI_BUS_ID")
        );
        assert_eq!(
            gpu_env_for(1, Some(list), None).unwrap(),
            pairs("MIG-0f1e2d3c-aaaa-bbbb-cccc-ddddeeeeffff", "PCI_BUS_ID")
        );
    }

    #[test]
    fn inherited_order_is_kept() {
        assert_eq!(
            gpu_env_for(0, Some("3"), Some("FASTEST_FIRST")).unwrap(),
            pairs("3", "FASTEST_FIRST")
        );
        assert_eq!(
            gpu_env_for(0, None, Some("")).unwrap(),
            pairs("0", "PCI_BUS_ID")
        );
    }

    #[test]
    fn out_of_range_and_empty_lists_are_errors() {
        let err = gpu_env_for(2, Some("0,1"), None).unwrap_err();
        assert_eq!(
            err,
            PlacementError::NoSuchEntry {
                entry: 2,
                count: 2,
                inherited: "0,1".into()
            }
        );
        assert!(gpu_env_for(0, Some(""), None).is_err());
        assert!(err.to_string().contains("lists 2 GPU(s)"));
    }

    #[test]
    fn parse_drops_empty_entries() {
        assert_eq!(parse_visible_devices(" 1, ,2,"), vec!["1", "2"]);
        assert!(parse_visible_devices("").is_empty());
    }
}
