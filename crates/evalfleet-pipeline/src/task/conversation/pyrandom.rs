//! Python's `random` module, as far as the original system draws from it:
//! `random.seed(n)` for an integer, `random.random()` and
//! `random.choice(seq)`, bit for bit (CPython's Mersenne Twister, seeded by
//! `init_by_array`, `random()` from two 32-bit outputs, `choice` by
//! rejection over `getrandbits(k)`). Seeded with the same integer it gives
//! the same draws as the original's Python.

use rand_mt::Mt;

pub struct PyRandom(Mt);

impl PyRandom {
    /// `random.seed(n)`: the key is `n`'s 32-bit words, least significant
    /// first (one word, 0, for 0).
    pub fn seed(n: u64) -> Self {
        let low = n as u32;
        let high = (n >> 32) as u32;
        let key: Vec<u32> = if high == 0 {
            vec![low]
        } else {
            vec![low, high]
        };
        Self(Mt::new_with_key(key))
    }

    /// `random.random()`: a float in [0, 1) with 53 random bits.
    pub fn random(&mut self) -> f64 {
        let a = f64::from(self.0.next_u32() >> 5);
        let b = f64::from(self.0.next_u32() >> 6);
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `random.getrandbits(k)` for 1 <= k <= 32.
    fn getrandbits(&mut self, k: u32) -> u32 {
        self.0.next_u32() >> (32 - k)
    }

    /// The index `random.choice` takes of a sequence of `n` (n >= 1): its
    /// `_randbelow(n)`.
    pub fn below(&mut self, n: usize) -> usize {
        let n = n.max(1) as u64;
        let k = (64 - n.leading_zeros()).min(32);
        loop {
            let r = u64::from(self.getrandbits(k));
            if r < n {
                return r as usize;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first three draws after `random.seed(1)`, as CPython 3.11 made
    /// them in the original's vectors (scenario tie_ab_ac's reset).
    #[test]
    fn draws_as_python_does() {
        let mut r = PyRandom::seed(1);
        assert_eq!(r.random(), 0.134_364_244_112_401_22);
        assert_eq!(r.random(), 0.847_433_736_937_232_7);
        assert_eq!(r.random(), 0.763_774_618_976_614);
        // `random.seed(5); [random.choice(range(45)) for _ in range(6)]`
        // and `random.seed(2**40 + 7); random.random()` in CPython 3.11.
        let mut r = PyRandom::seed(5);
        let picks: Vec<usize> = (0..6).map(|_| r.below(45)).collect();
        assert_eq!(picks, [39, 16, 22, 44, 41, 33]);
        assert_eq!(
            PyRandom::seed((1 << 40) + 7).random(),
            0.613_703_777_993_651_1
        );
    }
}
