//! The primitives of the binary exchange: LEB128 varints, zigzag, little-endian floats and
//! length-prefixed strings, written to a `Vec<u8>` and read from a slice that never reads
//! past its end (every read of untrusted input returns [`WireError::Truncated`] instead).
//!
//! Written by hand: the format is a few dozen lines of these, and the crates that offer
//! them (postcard, bincode) bring a serde data model whose optional fields and enums would
//! cost a byte each where the format packs them into one flags byte.

use super::WireError;

pub(super) fn put_u64(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(super) fn put_i64(out: &mut Vec<u8>, v: i64) {
    put_u64(out, ((v << 1) ^ (v >> 63)) as u64);
}

pub(super) fn put_f32(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_f64(out: &mut Vec<u8>, v: f64) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// An amount that is a whole number of thousandths (grants and asks are floored to them)
/// as that number, if that number gives it back bit for bit (-0.0 does not); `None` for
/// any other value, which then travels as an f64.
pub(super) fn as_milli(v: f64) -> Option<u64> {
    let m = (v * 1000.0).round();
    if !(0.0..(1u64 << 53) as f64).contains(&m) {
        return None;
    }
    let m = m as u64;
    (from_milli(m).to_bits() == v.to_bits()).then_some(m)
}

pub(super) fn from_milli(m: u64) -> f64 {
    m as f64 / 1000.0
}

/// A cursor over untrusted bytes.
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(super) fn u8(&mut self) -> Result<u8, WireError> {
        let b = *self.buf.get(self.pos).ok_or(WireError::Truncated)?;
        self.pos += 1;
        Ok(b)
    }

    pub(super) fn u64(&mut self) -> Result<u64, WireError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireError::BadVarint)
    }

    pub(super) fn i64(&mut self) -> Result<i64, WireError> {
        let v = self.u64()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    /// A count of items each at least `min_bytes` long: never more than the bytes left
    /// could hold, so that a forged count cannot make the decoder reserve memory.
    pub(super) fn count(&mut self, min_bytes: usize) -> Result<usize, WireError> {
        let n = self.u64()?;
        if n > (self.remaining() / min_bytes.max(1)) as u64 {
            return Err(WireError::Truncated);
        }
        Ok(n as usize)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    pub(super) fn f32(&mut self) -> Result<f32, WireError> {
        let b = self.take(4)?;
        Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(super) fn f64(&mut self) -> Result<f64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(f64::from_le_bytes(a))
    }

    pub(super) fn string(&mut self) -> Result<String, WireError> {
        let n = self.count(1)?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::NotUtf8)
    }

    pub(super) fn done(&self) -> Result<(), WireError> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(WireError::TrailingBytes)
        }
    }
}
