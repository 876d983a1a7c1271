//! Id allocation and slot assignment: pure logic, unit-tested.

use std::collections::{BTreeSet, HashSet};

/// Hands out ids in `1..limit`, moving forward and wrapping, so a freed id is reused as late as
/// possible: a stale conntrack entry naming a freed backend or service id is then far more
/// likely to find nothing than to find a stranger. The ids in use are a bit each, up to the
/// highest one taken (15 KiB for 120,000 backends, whose ids in a hash set took over a MiB).
#[derive(Debug)]
pub struct IdAllocator {
    limit: u32,
    next: u32,
    used: Vec<u64>,
    in_use: usize,
}

impl IdAllocator {
    /// Ids `1..limit`; 0 is never handed out.
    pub fn new(limit: u32) -> Self {
        Self { limit, next: 1, used: Vec::new(), in_use: 0 }
    }

    /// Sets `id`'s bit; false when it was set already.
    fn take(&mut self, id: u32) -> bool {
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        if word >= self.used.len() {
            self.used.resize(word + 1, 0);
        }
        let fresh = self.used[word] & bit == 0;
        self.used[word] |= bit;
        self.in_use += usize::from(fresh);
        fresh
    }

    /// Marks an id found in pinned state as taken. False when it is out of range.
    pub fn claim(&mut self, id: u32) -> bool {
        if id == 0 || id >= self.limit {
            return false;
        }
        self.take(id);
        if id >= self.next {
            self.next = if id + 1 >= self.limit { 1 } else { id + 1 };
        }
        true
    }

    pub fn alloc(&mut self) -> Option<u32> {
        let span = self.limit.saturating_sub(1);
        if self.in_use as u32 >= span {
            return None;
        }
        loop {
            let id = self.next;
            self.next = if id + 1 >= self.limit { 1 } else { id + 1 };
            if self.take(id) {
                return Some(id);
            }
        }
    }

    pub fn free(&mut self, id: u32) {
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        if let Some(w) = self.used.get_mut(word).filter(|w| **w & bit != 0) {
            *w &= !bit;
            self.in_use -= 1;
        }
    }

    pub fn in_use(&self) -> usize {
        self.in_use
    }
}

/// Values by id, for the ids an `IdAllocator` hands out: a Vec indexed by id, up to the highest
/// one set, and a bit per slot saying which hold a value. Ids start dense from 1; after much
/// churn they spread over `1..limit` (the allocator moves forward), and the Vec reaches `limit`
/// slots (its capacity up to twice that, as a Vec grows): for backends 12 bytes each (IPv6
/// 24), 3 MiB at a `--lb-map-max` of 262,144 (30,000 Services of 4 endpoints need over
/// 150,000 entries), where slots of `Option`s took 20 bytes (IPv6 32) and a hash map of
/// 120,000 backends 3.4 MiB. An empty slot holds `T::default()`.
#[derive(Debug)]
pub struct ById<T> {
    slots: Vec<T>,
    set: Vec<u64>,
}

impl<T> Default for ById<T> {
    fn default() -> Self {
        Self { slots: Vec::new(), set: Vec::new() }
    }
}

impl<T: Default> ById<T> {
    fn is_set(&self, at: usize) -> bool {
        self.set.get(at / 64).is_some_and(|w| w & (1 << (at % 64)) != 0)
    }

    pub fn get(&self, id: u32) -> Option<&T> {
        let at = id as usize;
        self.is_set(at).then(|| &self.slots[at])
    }

    pub fn insert(&mut self, id: u32, value: T) {
        let at = id as usize;
        if at >= self.slots.len() {
            self.slots.resize_with(at + 1, T::default);
            self.set.resize(at / 64 + 1, 0);
        }
        self.slots[at] = value;
        self.set[at / 64] |= 1 << (at % 64);
    }

    pub fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        let at = id as usize;
        self.is_set(at).then(|| &mut self.slots[at])
    }

    pub fn remove(&mut self, id: u32) -> Option<T> {
        let at = id as usize;
        if !self.is_set(at) {
            return None;
        }
        self.set[at / 64] &= !(1 << (at % 64));
        Some(std::mem::take(&mut self.slots[at]))
    }

    /// The ids set, in order, with their values.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots.iter().enumerate().filter(|(at, _)| self.is_set(*at)).map(|(at, v)| (at as u32, v))
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
    fn the_count_survives_repeats_and_ids_out_of_range() {
        let mut a = IdAllocator::new(130); // three words of bits
        assert!(a.claim(129));
        assert!(a.claim(129), "claimed twice (two pinned entries naming it)");
        assert_eq!(a.in_use(), 1);
        a.free(129);
        a.free(129);
        a.free(0);
        a.free(500);
        assert_eq!(a.in_use(), 0);
        assert_eq!((1..130).filter_map(|_| a.alloc()).count(), 129, "every id of 1..130 once");
        assert_eq!(a.alloc(), None);
    }

    #[test]
    fn values_by_id() {
        let mut m = ById::default();
        assert_eq!(m.get(7), None);
        m.insert(7, "seven");
        m.insert(2, "two");
        assert_eq!((m.get(7), m.get(2), m.get(3), m.get(8)), (Some(&"seven"), Some(&"two"), None, None));
        *m.get_mut(2).unwrap() = "deux";
        assert_eq!(m.iter().collect::<Vec<_>>(), [(2, &"deux"), (7, &"seven")]);
        assert_eq!(m.remove(7), Some("seven"));
        assert_eq!((m.remove(7), m.remove(100), m.get(7)), (None, None, None));
        // A value equal to the empty slot's is still there (and past a word of the bitmap).
        m.insert(3, "");
        m.insert(130, "");
        assert_eq!((m.get(3), m.get(130), m.get(129)), (Some(&""), Some(&""), None));
        assert_eq!(m.iter().map(|(id, _)| id).collect::<Vec<_>>(), [2, 3, 130]);
        assert_eq!((m.remove(130), m.get(130)), (Some(""), None));
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
