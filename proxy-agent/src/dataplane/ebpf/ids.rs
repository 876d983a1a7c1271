//! Id allocation and slot assignment: pure logic, unit-tested.

use std::collections::{BTreeSet, HashSet};

/// Hands out ids in `1..limit`, moving forward and wrapping, so a freed id is reused as late as
/// possible: a stale conntrack entry naming a freed backend or service id is then far more
/// likely to find nothing than to find a stranger.
#[derive(Debug)]
pub struct IdAllocator {
    limit: u32,
    next: u32,
    used: HashSet<u32>,
}

impl IdAllocator {
    /// Ids `1..limit`; 0 is never handed out.
    pub fn new(limit: u32) -> Self {
        Self { limit, next: 1, used: HashSet::new() }
    }

    /// Marks an id found in pinned state as taken. False when it is out of range.
    pub fn claim(&mut self, id: u32) -> bool {
        if id == 0 || id >= self.limit {
            return false;
        }
        self.used.insert(id);
        if id >= self.next {
            self.next = if id + 1 >= self.limit { 1 } else { id + 1 };
        }
        true
    }

    pub fn alloc(&mut self) -> Option<u32> {
        let span = self.limit.saturating_sub(1);
        if self.used.len() as u32 >= span {
            return None;
        }
        loop {
            let id = self.next;
            self.next = if id + 1 >= self.limit { 1 } else { id + 1 };
            if self.used.insert(id) {
                return Some(id);
            }
        }
    }

    pub fn free(&mut self, id: u32) {
        self.used.remove(&id);
    }

    pub fn in_use(&self) -> usize {
        self.used.len()
    }
}

/// New slot contents for a frontend: backends that stay keep their slot, new ones fill the
/// holes left by removed ones, then any hole left is filled from the tail. Few slots change,
/// so an endpoint change rewrites few map entries.
pub fn assign_slots(old: &[u32], wanted: &BTreeSet<u32>) -> Vec<u32> {
    // A backend keeps one slot: a change cut short (the agent killed between slot writes)
    // can leave one in two, and both copies kept would make the frontend count it twice.
    let mut kept: HashSet<u32> = HashSet::new();
    let mut slots: Vec<Option<u32>> = old.iter().map(|id| (wanted.contains(id) && kept.insert(*id)).then_some(*id)).collect();
    let mut added = wanted.iter().copied().filter(|id| !kept.contains(id));
    for s in slots.iter_mut().filter(|s| s.is_none()) {
        *s = added.next();
    }
    slots.extend(added.map(Some));
    let mut i = 0;
    while i < slots.len() {
        if slots[i].is_none() {
            while matches!(slots.last(), Some(None)) {
                slots.pop();
            }
            if i >= slots.len() {
                break;
            }
            slots[i] = slots.pop().flatten();
        }
        i += 1;
    }
    slots.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_left_in_two_slots_keeps_one() {
        let wanted: BTreeSet<u32> = [5].into();
        assert_eq!(assign_slots(&[5, 3, 4, 5], &wanted), vec![5]);
        let wanted: BTreeSet<u32> = [4, 5, 6].into();
        assert_eq!(assign_slots(&[5, 3, 4, 5], &wanted), vec![5, 6, 4]);
    }

    #[test]
    fn allocator_moves_forward_and_wraps() {
        let mut a = IdAllocator::new(4); // ids 1..=3
        assert_eq!(a.alloc(), Some(1));
        assert_eq!(a.alloc(), Some(2));
        a.free(1);
        assert_eq!(a.alloc(), Some(3), "a freed id is not reused while others are free");
        assert_eq!(a.alloc(), Some(1));
        assert_eq!(a.alloc(), None, "full");
        a.free(2);
        assert_eq!(a.alloc(), Some(2));
    }

    #[test]
    fn claimed_ids_are_skipped_and_out_of_range_refused() {
        let mut a = IdAllocator::new(10);
        assert!(a.claim(1));
        assert!(a.claim(5));
        assert!(!a.claim(0));
        assert!(!a.claim(10));
        assert_eq!(a.alloc(), Some(6), "allocation continues after the highest claimed id");
        assert_eq!(a.in_use(), 3);
    }

    #[test]
    fn ten_thousand_cycles_leak_nothing() {
        let mut a = IdAllocator::new(100);
        for _ in 0..10_000 {
            let ids: Vec<u32> = (0..50).map(|_| a.alloc().unwrap()).collect();
            ids.iter().for_each(|id| a.free(*id));
        }
        assert_eq!(a.in_use(), 0);
    }

    fn set(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    #[test]
    fn slots_are_stable() {
        assert_eq!(assign_slots(&[], &set(&[3, 1, 2])), vec![1, 2, 3]);
        assert_eq!(assign_slots(&[1, 2, 3], &set(&[1, 2, 3])), vec![1, 2, 3]);
        assert_eq!(assign_slots(&[1, 2, 3], &set(&[1, 3])), vec![1, 3], "tail moves into the hole");
        assert_eq!(assign_slots(&[1, 2, 3], &set(&[1, 3, 9])), vec![1, 9, 3], "new backend takes the hole");
        assert_eq!(assign_slots(&[1, 2, 3], &set(&[1, 2, 3, 4])), vec![1, 2, 3, 4]);
        assert_eq!(assign_slots(&[1, 2, 3], &set(&[])), Vec::<u32>::new());
        assert_eq!(assign_slots(&[1, 2, 3, 4], &set(&[4])), vec![4]);
        assert_eq!(assign_slots(&[1, 2, 3, 4], &set(&[1])), vec![1]);
    }

    #[test]
    fn slots_always_hold_exactly_the_wanted_set() {
        // Exhaustive over small old/new combinations.
        for old_mask in 0u32..64 {
            for new_mask in 0u32..64 {
                let old: Vec<u32> = (0..6).filter(|b| old_mask & (1 << b) != 0).collect();
                let wanted: BTreeSet<u32> = (0..6).filter(|b| new_mask & (1 << b) != 0).collect();
                let got = assign_slots(&old, &wanted);
                assert_eq!(got.iter().copied().collect::<BTreeSet<_>>(), wanted, "old {old:?}");
                assert_eq!(got.len(), wanted.len(), "no duplicates: old {old:?} got {got:?}");
            }
        }
    }
}
