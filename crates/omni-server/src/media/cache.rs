//! The multimodal processor cache (vLLM's `--mm-processor-cache-gb`, its "lru" type): items
//! already decoded and preprocessed, keyed by [`omni_mm::source_hash`] of their fetched bytes,
//! so a repeated image or clip skips the decoder and the preprocessor. Bounded by the bytes of
//! the items' tensors; the least recently used item goes first. The tensors are reference-counted
//! (`Bytes`), so a hit shares them with the entry, and an entry with the requests that used it.
//!
//! Bytes are still fetched (a URL's content may change) and still cross the queues to the engine
//! (vLLM's "shm" cache type, which keeps them out of the queue, is not here).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use omni_mm::ContentHash;

use super::MmInput;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct ProcessorCache {
    capacity: usize,
    inner: Mutex<Lru>,
}

#[derive(Debug, Default)]
struct Lru {
    /// Item and its last use.
    entries: HashMap<ContentHash, (MmInput, u64)>,
    /// Last use to key, oldest first.
    order: BTreeMap<u64, ContentHash>,
    bytes: usize,
    tick: u64,
}

impl ProcessorCache {
    /// A cache of at most `gib` GiB of tensors; `None` when `gib` is 0 (or not a positive
    /// number).
    pub(crate) fn new(gib: f64) -> Option<Self> {
        if gib.is_nan() || gib <= 0.0 {
            return None;
        }
        let capacity = (gib * f64::from(1u32 << 30)).min(usize::MAX as f64);
        (capacity >= 1.0).then(|| Self {
            capacity: capacity as usize,
            inner: Mutex::new(Lru::default()),
        })
    }

    /// The item with this source, marked as just used.
    pub(crate) fn get(&self, key: &ContentHash) -> Option<MmInput> {
        let mut l = self.inner.lock().ok()?;
        let tick = l.next_tick();
        let (item, last) = l.entries.get_mut(key)?;
        let (item, old) = (item.clone(), std::mem::replace(last, tick));
        l.order.remove(&old);
        l.order.insert(tick, *key);
        Some(item)
    }

    /// Keeps `item` under `key`, dropping the least recently used items until it fits (an item
    /// larger than the whole cache is not kept).
    pub(crate) fn insert(&self, key: ContentHash, item: &MmInput) {
        let size = item.data.len();
        let Ok(mut l) = self.inner.lock() else {
            return;
        };
        if size > self.capacity || l.entries.contains_key(&key) {
            return;
        }
        while l.bytes + size > self.capacity {
            let Some((_, oldest)) = l.order.pop_first() else {
                break;
            };
            if let Some((gone, _)) = l.entries.remove(&oldest) {
                l.bytes -= gone.data.len();
            }
        }
        let tick = l.next_tick();
        let mut kept = item.clone();
        kept.uuid = None;
        kept.offset = 0;
        l.entries.insert(key, (kept, tick));
        l.order.insert(tick, key);
        l.bytes += size;
    }

    /// Items held and their tensor bytes.
    #[cfg(test)]
    fn usage(&self) -> (usize, usize) {
        self.inner
            .lock()
            .map(|l| (l.entries.len(), l.bytes))
            .unwrap_or_default()
    }
}

impl Lru {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use omni_mm::{Modality, source_hash};

    use super::*;

    fn item(bytes: usize, tag: u8) -> MmInput {
        MmInput {
            modality: Modality::Image,
            data: vec![tag; bytes].into(),
            shape: [1, bytes / 2],
            grid_thw: Some([1, 2, 2]),
            num_frames: None,
            num_tokens: 1,
            content_hash: source_hash(Modality::Image, None, &[tag]),
            offset: 7,
            uuid: Some("u".into()),
        }
    }

    fn key(tag: u8) -> ContentHash {
        source_hash(Modality::Image, Some("image/png"), &[tag])
    }

    #[test]
    fn the_least_recently_used_item_goes_first_and_a_hit_shares_the_bytes() {
        let c = ProcessorCache::new(3000.0 / f64::from(1u32 << 30)).unwrap();
        for t in 0..3 {
            c.insert(key(t), &item(1000, t));
        }
        assert_eq!(c.usage(), (3, 3000));
        // Item 0 is used again: item 1 is now the oldest and makes room for item 3.
        let hit = c.get(&key(0)).unwrap();
        assert_eq!(
            (hit.offset, hit.uuid.as_deref()),
            (0, None),
            "no request's fields"
        );
        c.insert(key(3), &item(1000, 3));
        assert!(c.get(&key(1)).is_none());
        for t in [0, 2, 3] {
            assert_eq!(c.get(&key(t)).unwrap().data[0], t);
        }
        assert_eq!(c.usage(), (3, 3000));
        // Shared, not copied.
        let a = c.get(&key(0)).unwrap();
        let b = c.get(&key(0)).unwrap();
        assert_eq!(a.data.as_ptr(), b.data.as_ptr());
        // Too large for the whole cache: not kept, nothing dropped for it.
        c.insert(key(9), &item(4000, 9));
        assert!(c.get(&key(9)).is_none());
        assert_eq!(c.usage(), (3, 3000));
    }

    #[test]
    fn zero_gib_is_no_cache() {
        assert!(ProcessorCache::new(0.0).is_none());
        assert!(ProcessorCache::new(-1.0).is_none());
        assert!(ProcessorCache::new(f64::NAN).is_none());
    }
}
