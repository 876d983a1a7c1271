//! The writer's side of the frontend filter (`proxy_common::filter`): a bit per frontend hash,
//! which the datapath reads before it looks a destination up in the services map. A bit must
//! be set before any master entry it stands for is written, and may be cleared only once the
//! last such entry is gone; a bit set for nothing costs a lookup, a bit missing loses a
//! Service. So each bit counts the master entries (a frontend's scopes) it stands for, and
//! every word whose kernel value may differ from the counts is written again later.

use std::collections::{BTreeSet, HashMap};

use aya::maps::MapError;
use proxy_common::{
    filter::{self, Addr},
    ServiceKey,
};

use super::tables::Table;

pub struct Filter {
    table: Box<dyn Table<u32, u64>>,
    /// The bits of one master entry or more: the words the kernel should hold (empty until
    /// the first, then 32 KiB).
    words: Vec<u64>,
    /// Entries beyond the first of a bit that stands for more than one (two scopes of a
    /// frontend, or frontends whose hashes meet): a few per thousand frontends, where a count
    /// per bit would take 256 KiB.
    more: HashMap<u32, u32>,
    /// Words whose kernel value may differ from `words` (a failed write).
    dirty: BTreeSet<u32>,
}

/// The word and the mask of `key`'s bit, and the bit's number.
fn place<A: Addr>(key: &ServiceKey<A>) -> (u32, u64, u32) {
    let (word, mask) = filter::place(key.addr, key.port, key.proto);
    (word, mask, word * 64 + mask.trailing_zeros())
}

impl Filter {
    pub fn new(table: Box<dyn Table<u32, u64>>) -> Self {
        Self { table, words: Vec::new(), more: HashMap::new(), dirty: BTreeSet::new() }
    }

    fn word(&self, word: u32) -> u64 {
        self.words.get(word as usize).copied().unwrap_or(0)
    }

    fn write(&mut self, word: u32) -> Result<(), MapError> {
        let value = self.word(word);
        match self.table.put(&word, &value) {
            Ok(()) => {
                self.dirty.remove(&word);
                Ok(())
            }
            Err(e) => {
                self.dirty.insert(word);
                Err(e)
            }
        }
    }

    /// Counts one more master entry at `key`'s bit, without writing; true when the bit was
    /// clear.
    fn count<A: Addr>(&mut self, key: &ServiceKey<A>) -> bool {
        if self.words.is_empty() {
            self.words = vec![0; filter::WORDS as usize];
        }
        let (word, mask, bit) = place(key);
        let w = &mut self.words[word as usize];
        if *w & mask == 0 {
            *w |= mask;
            return true;
        }
        *self.more.entry(bit).or_default() += 1;
        false
    }

    /// Counts one master entry less at `key`'s bit; true when that was the last.
    fn uncount<A: Addr>(&mut self, key: &ServiceKey<A>) -> bool {
        let (word, mask, bit) = place(key);
        if let Some(n) = self.more.get_mut(&bit) {
            *n -= 1;
            if *n == 0 {
                self.more.remove(&bit);
            }
            return false;
        }
        match self.words.get_mut(word as usize) {
            Some(w) if *w & mask != 0 => {
                *w &= !mask;
                true
            }
            _ => false,
        }
    }

    /// Takes over a previous run's filter (`found`: its words, missing ones unset) for the
    /// master entries `masters` the maps hold, writing only the words that differ. An error:
    /// a word could not be written, and may lack the bit of an adopted master.
    pub fn adopt<'a, A: Addr + 'a>(&mut self, found: &[u64], masters: impl IntoIterator<Item = &'a ServiceKey<A>>) -> Result<(), MapError> {
        for key in masters {
            self.count(key);
        }
        for word in 0..filter::WORDS {
            if found.get(word as usize).copied().unwrap_or(0) != self.word(word) {
                self.write(word)?;
            }
        }
        Ok(())
    }

    /// Before master entry `key` is first written: its bit is set in the kernel when this
    /// returns Ok. On an error nothing is counted.
    pub fn hold<A: Addr>(&mut self, key: &ServiceKey<A>) -> Result<(), MapError> {
        let (word, _, _) = place(key);
        if !self.count(key) && !self.dirty.contains(&word) {
            return Ok(());
        }
        self.write(word).inspect_err(|_| {
            self.uncount(key);
        })
    }

    /// After master entry `key` was deleted (or never written): its bit is cleared once no
    /// other entry needs it. A failed write leaves the bit set until `retry`.
    pub fn release<A: Addr>(&mut self, key: &ServiceKey<A>) {
        if self.uncount(key) {
            let (word, _, _) = place(key);
            let _ = self.write(word);
        }
    }

    /// Writes again the words a failed write left.
    pub fn retry(&mut self) -> usize {
        let words: Vec<u32> = self.dirty.iter().copied().collect();
        words.into_iter().filter(|w| self.write(*w).is_ok()).count()
    }

    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::BTreeMap,
        io,
        sync::{Arc, Mutex},
    };

    use super::*;

    /// The kernel's words, and whether writes fail.
    #[derive(Default)]
    struct Words {
        words: BTreeMap<u32, u64>,
        failing: bool,
        writes: usize,
    }

    struct Fake(Arc<Mutex<Words>>);

    impl Table<u32, u64> for Fake {
        fn put(&mut self, key: &u32, value: &u64) -> Result<(), MapError> {
            let mut w = self.0.lock().unwrap();
            if w.failing {
                return Err(MapError::KeyNotFound);
            }
            w.writes += 1;
            w.words.insert(*key, *value);
            Ok(())
        }
        fn del(&mut self, key: &u32) -> Result<(), MapError> {
            self.put(key, &0)
        }
        fn count(&self) -> io::Result<u64> {
            Ok(0)
        }
    }

    fn set(words: &Arc<Mutex<Words>>, key: &ServiceKey) -> bool {
        let (word, bit) = filter::place(key.addr, key.port, key.proto);
        words.lock().unwrap().words.get(&word).is_some_and(|w| w & bit != 0)
    }

    /// A filter over an empty fake kernel, and a frontend.
    fn fresh() -> (Arc<Mutex<Words>>, Filter, ServiceKey) {
        let words = Arc::new(Mutex::new(Words::default()));
        let f = Filter::new(Box::new(Fake(words.clone())));
        (words, f, ServiceKey::new([10, 96, 0, 1], 80u16.to_be_bytes(), 6, 0))
    }

    /// A second frontend whose bit is `key`'s (found by trying ports).
    fn twin(key: &ServiceKey) -> ServiceKey {
        (1..=u16::MAX)
            .map(|p| ServiceKey::new([10, 96, 7, 7], p.to_be_bytes(), 6, 0))
            .find(|k| place(k).2 == place(key).2 && k != key)
            .expect("a key sharing the bit")
    }

    #[test]
    fn a_bit_shared_by_two_frontends_stays_until_both_are_gone() {
        let (words, mut f, a) = fresh();
        let b = twin(&a);
        f.hold(&a).expect("hold a");
        assert!(set(&words, &a));
        let writes = words.lock().unwrap().writes;
        f.hold(&b).expect("hold b");
        assert_eq!(words.lock().unwrap().writes, writes, "a bit already set is not written again");
        f.release(&a);
        assert!(set(&words, &b), "b still needs the bit");
        f.release(&b);
        assert!(!set(&words, &a), "cleared with the last one");
        assert_eq!(words.lock().unwrap().words.values().copied().sum::<u64>(), 0);
    }

    #[test]
    fn a_failed_write_is_not_counted_and_a_failed_clear_is_retried() {
        let (words, mut f, a) = fresh();
        words.lock().unwrap().failing = true;
        assert!(f.hold(&a).is_err());
        words.lock().unwrap().failing = false;
        f.hold(&a).expect("hold");
        f.release(&a);
        assert!(!set(&words, &a), "one hold counted, not two");

        f.hold(&a).expect("hold");
        words.lock().unwrap().failing = true;
        f.release(&a);
        assert!(set(&words, &a) && f.has_dirty(), "the clear failed: the bit stays, marked");
        words.lock().unwrap().failing = false;
        assert_eq!(f.retry(), 1);
        assert!(!set(&words, &a) && !f.has_dirty());
    }

    /// A shared bit whose word is dirty: a failed hold takes back only its own count.
    #[test]
    fn a_failed_hold_of_a_shared_bit_leaves_the_first_holder_its_bit() {
        let (words, mut f, a) = fresh();
        let b = twin(&a);
        f.hold(&a).expect("hold a");
        let other = ServiceKey::new([10, 96, 0, 9], 443u16.to_be_bytes(), 6, 0);
        let other = (1..=u16::MAX)
            .map(|p| ServiceKey::new(other.addr, p.to_be_bytes(), 6, 0))
            .find(|k| place(k).0 == place(&a).0 && place(k).2 != place(&a).2)
            .expect("a key in a's word");
        // A failed clear in the word leaves it dirty; b's hold then must write it, and fails.
        f.hold(&other).expect("hold other");
        words.lock().unwrap().failing = true;
        f.release(&other);
        assert!(f.has_dirty());
        assert!(f.hold(&b).is_err(), "the dirty word's write fails");
        words.lock().unwrap().failing = false;
        assert!(set(&words, &a), "a keeps its bit");
        // b's failed hold was not counted: a's release is the bit's last.
        f.release(&a);
        assert!(!set(&words, &a) && !set(&words, &other) && !f.has_dirty(), "the word is written whole, clean");
    }

    #[test]
    fn adopting_writes_only_the_words_that_differ() {
        let words = Arc::new(Mutex::new(Words::default()));
        let a = ServiceKey::new([10, 96, 0, 1], 80u16.to_be_bytes(), 6, 0);
        let stale = ServiceKey::new([10, 96, 0, 2], 53u16.to_be_bytes(), 17, 0);
        let mut found = vec![0u64; filter::WORDS as usize];
        let (wa, ba) = filter::place(a.addr, a.port, a.proto);
        let (ws, bs) = filter::place(stale.addr, stale.port, stale.proto);
        found[wa as usize] |= ba;
        found[ws as usize] |= bs;
        let mut f = Filter::new(Box::new(Fake(words.clone())));
        f.adopt(&found, [&a]).expect("adopt");
        let w = words.lock().unwrap();
        assert_eq!(w.writes, 1, "one word rewritten: the stale bit's");
        assert_eq!(w.words.get(&ws).copied(), Some(if wa == ws { ba } else { 0 }), "the stale bit is cleared, the live one kept");
    }
}
