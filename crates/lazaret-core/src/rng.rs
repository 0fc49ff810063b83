//! Randomness as an input: the core asks an [`Entropy`] source, never the OS.

/// A source of uniformly distributed 64-bit words.
///
/// The server passes one seeded from the OS; tests and the simulator pass a
/// [`SplitMix64`] with a fixed seed so that every run can be replayed.
pub trait Entropy {
    /// The next uniformly distributed word.
    fn next_u64(&mut self) -> u64;

    /// A uniform integer in `0..=max` (inclusive), without modulo bias worth
    /// measuring (Lemire's multiply-shift on 64 bits).
    fn below_inclusive(&mut self, max: u64) -> u64 {
        if max == u64::MAX {
            return self.next_u64();
        }
        let range = u128::from(max) + 1;
        ((u128::from(self.next_u64()) * range) >> 64) as u64
    }
}

/// SplitMix64: tiny, fast, and good enough for jitter and simulation.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose whole future is fixed by `seed`.
    pub const fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }
}

impl Entropy for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl<E: Entropy + ?Sized> Entropy for &mut E {
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    #[test]
    fn below_inclusive_stays_in_range() {
        let mut r = SplitMix64::new(1);
        for max in [0, 1, 2, 7, 1000, u64::MAX - 1, u64::MAX] {
            for _ in 0..200 {
                assert!(r.below_inclusive(max) <= max);
            }
        }
        assert_eq!(r.below_inclusive(0), 0);
    }
}
