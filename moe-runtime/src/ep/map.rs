//! Which rank owns which expert.

use super::EpError;

/// The owner of every expert and each expert's index among its owner's experts (the order of
/// that rank's local weights). Validated once, here: every expert owned by exactly one rank,
/// every rank owning at least one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExpertMap {
    owner: Vec<u32>,
    local: Vec<u32>,
    counts: Vec<u32>,
}

impl ExpertMap {
    /// Contiguous slices: rank r owns experts `[r E / R, (r + 1) E / R)` (the usual placement).
    pub fn contiguous(experts: u32, ranks: usize) -> Result<ExpertMap, EpError> {
        if ranks == 0 {
            return Err(EpError::ExpertMap("no ranks".into()));
        }
        let owner = (0..experts as u64).map(|e| (e * ranks as u64 / experts.max(1) as u64) as u32).collect();
        ExpertMap::from_owners(owner, ranks)
    }

    /// `owner[e]`: the rank that holds expert e; local indices follow expert order.
    pub fn from_owners(owner: Vec<u32>, ranks: usize) -> Result<ExpertMap, EpError> {
        if ranks == 0 || ranks > moe_codegen::EP_MAX_RANKS as usize {
            return Err(EpError::ExpertMap(format!("{ranks} ranks (1 to {} supported)", moe_codegen::EP_MAX_RANKS)));
        }
        let mut counts = vec![0u32; ranks];
        let mut local = Vec::with_capacity(owner.len());
        for (e, &r) in owner.iter().enumerate() {
            let Some(c) = counts.get_mut(r as usize) else {
                return Err(EpError::ExpertMap(format!("expert {e} is given to rank {r} of {ranks}")));
            };
            local.push(*c);
            *c += 1;
        }
        if let Some(r) = counts.iter().position(|&c| c == 0) {
            return Err(EpError::ExpertMap(format!("rank {r} owns no expert")));
        }
        Ok(ExpertMap { owner, local, counts })
    }

    /// `lists[r]`: the experts rank r holds, in the order of its local weights. Every expert in
    /// `[0, experts)` must appear exactly once.
    pub fn from_lists(lists: &[Vec<u32>], experts: u32) -> Result<ExpertMap, EpError> {
        let mut owner = vec![u32::MAX; experts as usize];
        let mut local = vec![0u32; experts as usize];
        for (r, list) in lists.iter().enumerate() {
            for (i, &e) in list.iter().enumerate() {
                let Some(o) = owner.get_mut(e as usize) else {
                    return Err(EpError::ExpertMap(format!("rank {r} lists expert {e}, of {experts}")));
                };
                if *o != u32::MAX {
                    return Err(EpError::ExpertMap(format!("expert {e} is listed by ranks {} and {r}", *o)));
                }
                *o = r as u32;
                local[e as usize] = i as u32;
            }
        }
        if let Some(e) = owner.iter().position(|&o| o == u32::MAX) {
            return Err(EpError::ExpertMap(format!("expert {e} is owned by no rank")));
        }
        let mut map = ExpertMap::from_owners(owner, lists.len())?;
        map.local = local;
        Ok(map)
    }

    /// Experts in the layer.
    pub fn experts(&self) -> u32 {
        self.owner.len() as u32
    }
    /// Ranks the experts are spread over.
    pub fn ranks(&self) -> usize {
        self.counts.len()
    }
    /// The rank that holds expert `e`.
    pub fn owner(&self, e: u32) -> usize {
        self.owner[e as usize] as usize
    }
    /// Expert `e`'s index among its owner's experts.
    pub fn local_index(&self, e: u32) -> u32 {
        self.local[e as usize]
    }
    /// The experts rank `r` holds, in local order.
    pub fn experts_of(&self, r: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (0..self.experts()).filter(|&e| self.owner(e) == r).collect();
        v.sort_by_key(|&e| self.local[e as usize]);
        v
    }
    /// How many experts rank `r` holds.
    pub fn count(&self, r: usize) -> u32 {
        self.counts[r]
    }
    pub(crate) fn owners_i32(&self) -> Vec<i32> {
        self.owner.iter().map(|&o| o as i32).collect()
    }
    pub(crate) fn locals_i32(&self) -> Vec<i32> {
        self.local.iter().map(|&l| l as i32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_slices() {
        let m = ExpertMap::contiguous(128, 2).unwrap();
        assert_eq!((m.owner(0), m.owner(63), m.owner(64), m.owner(127)), (0, 0, 1, 1));
        assert_eq!((m.local_index(64), m.count(0), m.count(1)), (0, 64, 64));
        assert_eq!(m.experts_of(1), (64..128).collect::<Vec<_>>());
        let odd = ExpertMap::contiguous(7, 3).unwrap();
        assert_eq!((0..3).map(|r| odd.count(r)).sum::<u32>(), 7);
    }

    #[test]
    fn a_map_that_drops_or_doubles_an_expert_is_refused() {
        let drop = ExpertMap::from_lists(&[(0..63).collect(), (64..128).collect()], 128);
        assert!(matches!(drop, Err(EpError::ExpertMap(w)) if w.contains("expert 63")));
        let twice = ExpertMap::from_lists(&[(0..64).collect(), (63..128).collect()], 128);
        assert!(matches!(twice, Err(EpError::ExpertMap(w)) if w.contains("ranks 0 and 1")));
        assert!(matches!(ExpertMap::from_owners(vec![0, 0, 2], 2), Err(EpError::ExpertMap(_))));
        assert!(matches!(ExpertMap::from_owners(vec![0, 0], 2), Err(EpError::ExpertMap(w)) if w.contains("rank 1")));
    }

    #[test]
    fn lists_keep_their_local_order() {
        let m = ExpertMap::from_lists(&[vec![3, 0], vec![1, 2]], 4).unwrap();
        assert_eq!((m.local_index(3), m.local_index(0), m.owner(2)), (0, 1, 1));
        assert_eq!(m.experts_of(0), vec![3, 0]);
    }
}
