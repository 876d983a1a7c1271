//! The seam between the load-balancer map writer and the kernel: the writer changes each map
//! only through `Table`'s two calls, so its transactions (the make-before-break order and the
//! undo of a failed change) run as plain unit tests against in-memory tables that record
//! every call and can fail any one of them (`lbmaps` tests), as aya's own tests fake the
//! syscalls beneath its maps.

use std::{io, os::fd::AsFd as _};

use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        Array, HashMap, IterableMap as _, MapData, MapError,
    },
    Pod,
};

/// One map as the writer uses it.
pub trait Table<K, V>: Send {
    /// Creates or replaces the entry at `key`.
    fn put(&mut self, key: &K, value: &V) -> Result<(), MapError>;
    /// Deletes the entry at `key` (an array's entry becomes its unset value).
    fn del(&mut self, key: &K) -> Result<(), MapError>;
    /// Entries the map holds (an array's set ones), counted in the map itself.
    fn count(&self) -> io::Result<u64>;
    /// The kernel map's descriptor, for readers beside the writer (none: not a kernel map).
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
}

impl<K: Pod + Send, V: Pod + Send> Table<K, V> for HashMap<MapData, K, V> {
    fn put(&mut self, key: &K, value: &V) -> Result<(), MapError> {
        self.insert(key, value, 0)
    }

    fn del(&mut self, key: &K) -> Result<(), MapError> {
        self.remove(key)
    }

    fn count(&self) -> io::Result<u64> {
        super::batch::count_entries(self.map().fd().as_fd(), size_of::<K>(), size_of::<V>())
    }

    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.map().fd().as_fd())
    }
}

/// An array's entry equal to `V::default()` is unset.
impl<V: Pod + Send + Default + PartialEq> Table<u32, V> for Array<MapData, V> {
    fn put(&mut self, key: &u32, value: &V) -> Result<(), MapError> {
        self.set(*key, value, 0)
    }

    fn del(&mut self, key: &u32) -> Result<(), MapError> {
        self.set(*key, V::default(), 0)
    }

    fn count(&self) -> io::Result<u64> {
        Ok(self.iter().filter(|v| v.as_ref().is_ok_and(|v| *v != V::default())).count() as u64)
    }
}

impl<K: Pod + Send, V: Pod + Send> Table<Key<K>, V> for LpmTrie<MapData, K, V> {
    fn put(&mut self, key: &Key<K>, value: &V) -> Result<(), MapError> {
        self.insert(key, value, 0)
    }

    fn del(&mut self, key: &Key<K>) -> Result<(), MapError> {
        self.remove(key)
    }

    fn count(&self) -> io::Result<u64> {
        Ok(self.keys().filter(|k| k.is_ok()).count() as u64)
    }
}
