//! Stress marks on phoneme strings: the primary `ˈ` and secondary `ˌ` marks, moved, demoted or
//! added by a stress level (misaki's convention: below -1 drops all, -1 and 0 demote, 0.5 to 2 add
//! or promote).

pub const PRIMARY: char = 'ˈ';
pub const SECONDARY: char = 'ˌ';
pub const VOWELS: &str = "AIOQWYaiuæɑɒɔəɛɜɪʊʌᵻ";
pub const CONSONANTS: &str = "bdfhjklmnpstvwzðŋɡɹɾʃʒʤʧθ";
const DIPHTHONGS: &str = "AIOQWYʤʧ";

pub fn is_vowel(c: char) -> bool {
    VOWELS.contains(c)
}

fn is_stress(c: char) -> bool {
    c == PRIMARY || c == SECONDARY
}

/// Phoneme weight for choosing which parts of a compound keep their stress.
pub fn stress_weight(ps: &str) -> usize {
    ps.chars()
        .map(|c| if DIPHTHONGS.contains(c) { 2 } else { 1 })
        .sum()
}

/// Moves each stress mark to just before the first vowel at or after it.
fn restress(ps: &str) -> String {
    let chars: Vec<char> = ps.chars().collect();
    let mut keyed: Vec<(f64, char)> = chars
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let pos = if is_stress(c) {
                match chars[i..].iter().position(|&v| is_vowel(v)) {
                    Some(off) => (i + off) as f64 - 0.5,
                    None => i as f64,
                }
            } else {
                i as f64
            };
            (pos, c)
        })
        .collect();
    keyed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    keyed.into_iter().map(|(_, c)| c).collect()
}

fn has_vowel(ps: &str) -> bool {
    ps.chars().any(is_vowel)
}

fn demote(ps: &str) -> String {
    ps.replace(SECONDARY, "")
        .replace(PRIMARY, &SECONDARY.to_string())
}

/// Applies a stress level; `None` leaves the string as it is.
pub fn apply_stress(ps: &str, stress: Option<f64>) -> String {
    let Some(stress) = stress else {
        return ps.to_string();
    };
    let unstressed = !ps.chars().any(is_stress);
    if stress < -1.0 {
        ps.replace([PRIMARY, SECONDARY], "")
    } else if stress == -1.0 || ((stress == 0.0 || stress == -0.5) && ps.contains(PRIMARY)) {
        demote(ps)
    } else if (stress == 0.0 || stress == 0.5 || stress == 1.0) && unstressed {
        if !has_vowel(ps) {
            return ps.to_string();
        }
        restress(&format!("{SECONDARY}{ps}"))
    } else if stress >= 1.0 && !ps.contains(PRIMARY) && ps.contains(SECONDARY) {
        ps.replace(SECONDARY, &PRIMARY.to_string())
    } else if stress > 1.0 && unstressed {
        if !has_vowel(ps) {
            return ps.to_string();
        }
        restress(&format!("{PRIMARY}{ps}"))
    } else {
        ps.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stress_levels() {
        assert_eq!(apply_stress("hˈɛlO", Some(-0.5)), "hˌɛlO");
        assert_eq!(apply_stress("kæt", Some(2.0)), "kˈæt");
        assert_eq!(apply_stress("kæt", Some(0.5)), "kˌæt");
        assert_eq!(apply_stress("kˌæt", Some(2.0)), "kˈæt");
        assert_eq!(apply_stress("kˈæt", Some(-2.0)), "kæt");
        assert_eq!(apply_stress("st", Some(2.0)), "st");
    }
}
