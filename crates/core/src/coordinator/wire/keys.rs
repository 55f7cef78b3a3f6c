//! The key dictionary of one direction of one link: the sender numbers the keys it
//! reports, spells a key out until the receiver is known to have it, and from then on
//! sends only its number.
//!
//! The receiver is known to have a key once a reply came back to an exchange that spelled
//! it out (a reply is only ever made from an exchange the receiver decoded). A receiver
//! that lost its table (a restart, another instance taking over its region) refuses a
//! number it does not know with [`WireError::UnknownKey`]; the sender then starts a new
//! dictionary, an *epoch*, and spells every key out again. A dictionary also starts over
//! when it would hold more than its cap (keys that came and went): both ends hold at most
//! `cap` keys per peer.

use std::collections::HashMap;

use super::WireError;

/// The sender's numbering of keys for one peer.
#[derive(Debug, Clone)]
pub struct KeyIds {
    epoch: u64,
    ids: HashMap<String, u32>,
    /// By number: whether the receiver is known to have it.
    confirmed: Vec<bool>,
    cap: usize,
}

/// What one encoded exchange spelled out: a reply to it confirms these.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spelled {
    epoch: u64,
    ids: Vec<u32>,
}

impl Spelled {
    /// The epoch the keys were spelled in.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

impl KeyIds {
    /// An empty dictionary of at most `cap` keys (at least one).
    pub fn new(cap: usize) -> Self {
        KeyIds {
            epoch: 1,
            ids: HashMap::new(),
            confirmed: Vec::new(),
            cap: cap.clamp(1, u32::MAX as usize),
        }
    }

    /// The dictionary's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Keys numbered in this epoch.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no key is numbered in this epoch.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Starts a new epoch: every key is spelled out again.
    pub fn reset(&mut self) {
        self.epoch += 1;
        self.ids.clear();
        self.confirmed.clear();
    }

    /// The peer refused a number of `epoch`: if that is still the current one, start a
    /// new one (a refusal of an older epoch's message says nothing about this one).
    /// Returns whether it started over.
    pub fn refused(&mut self, epoch: u64) -> bool {
        let current = epoch == self.epoch;
        if current {
            self.reset();
        }
        current
    }

    /// Makes room for `keys` before a message is encoded: a new epoch if numbering the
    /// ones not yet numbered would pass the cap.
    pub(super) fn prepare<'a>(&mut self, keys: impl Iterator<Item = &'a str>) {
        let new = keys.filter(|k| !self.ids.contains_key(*k)).count();
        if self.ids.len() + new > self.cap {
            self.reset();
        }
    }

    /// The key's number, and whether it must be spelled out (noted in `spelled`).
    pub(super) fn number(&mut self, key: &str, spelled: &mut Spelled) -> (u32, bool) {
        let next = self.ids.len() as u32;
        let id = *self.ids.entry(key.to_owned()).or_insert(next);
        if id == next {
            self.confirmed.push(false);
        }
        let spell = !self.confirmed[id as usize];
        if spell {
            spelled.ids.push(id);
        }
        (id, spell)
    }

    pub(super) fn spelled(&self) -> Spelled {
        Spelled {
            epoch: self.epoch,
            ids: Vec::new(),
        }
    }

    /// A reply came back to the message that spelled these out.
    pub fn confirm(&mut self, spelled: &Spelled) {
        if spelled.epoch != self.epoch {
            return;
        }
        for &id in &spelled.ids {
            if let Some(c) = self.confirmed.get_mut(id as usize) {
                *c = true;
            }
        }
    }
}

/// The receiver's table of one peer's keys.
#[derive(Debug, Clone)]
pub struct KeyTable {
    /// The sender's incarnation and epoch this table belongs to.
    epoch: Option<(u64, u64)>,
    keys: Vec<Option<Box<str>>>,
    /// How many of `keys` are spelled.
    known: usize,
    cap: usize,
}

impl KeyTable {
    /// An empty table of at most `cap` keys (at least one).
    pub fn new(cap: usize) -> Self {
        KeyTable {
            epoch: None,
            keys: Vec::new(),
            known: 0,
            cap: cap.clamp(1, u32::MAX as usize),
        }
    }

    /// Keys known.
    pub fn len(&self) -> usize {
        self.known
    }

    /// Whether no key is known.
    pub fn is_empty(&self) -> bool {
        self.known == 0
    }

    /// A message of the sender's `incarnation` and dictionary `epoch` begins: a newer one
    /// than the table's empties it; an older one is refused (a late retry of a message the
    /// sender has moved on from).
    pub(super) fn begin(&mut self, incarnation: u64, epoch: u64) -> Result<(), WireError> {
        let at = (incarnation, epoch);
        match self.epoch {
            Some(cur) if cur == at => Ok(()),
            Some(cur) if cur > at => Err(WireError::StaleDictionary),
            _ => {
                self.epoch = Some(at);
                self.keys.clear();
                self.known = 0;
                Ok(())
            }
        }
    }

    pub(super) fn define(&mut self, id: u32, key: &str) -> Result<(), WireError> {
        let i = id as usize;
        if i >= self.cap {
            return Err(WireError::DictionaryFull);
        }
        if self.keys.len() <= i {
            self.keys.resize(i + 1, None);
        }
        if self.keys[i].replace(key.into()).is_none() {
            self.known += 1;
        }
        Ok(())
    }

    pub(super) fn get(&self, id: u32) -> Result<&str, WireError> {
        self.keys
            .get(id as usize)
            .and_then(|k| k.as_deref())
            .ok_or(WireError::UnknownKey)
    }
}
