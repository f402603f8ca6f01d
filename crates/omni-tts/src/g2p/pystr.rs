//! Character and string predicates with the meaning the reference's rules were written against
//! (Python's `str.isalpha`, `islower`, `isupper`, `isdigit`, `capitalize`), for Latin text.

/// `str.isalpha()`: non-empty, every character a letter.
pub fn is_alpha(s: &str) -> bool {
    !s.is_empty() && s.chars().all(char::is_alphabetic)
}

/// `str.isdigit()` for one character: ASCII digits and the superscript / subscript digits
/// (other scripts' digits are not read as numbers).
pub fn is_digit_char(c: char) -> bool {
    c.is_ascii_digit() || matches!(c, '²' | '³' | '¹' | '⁰' | '⁴'..='⁹' | '₀'..='₉')
}

/// Non-empty and ASCII digits only (the lexicon's `^[0-9]+$`).
pub fn is_ascii_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// `str.isdigit()`.
pub fn is_digit(s: &str) -> bool {
    !s.is_empty() && s.chars().all(is_digit_char)
}

fn is_cased(c: char) -> bool {
    c.is_lowercase() || c.is_uppercase()
}

/// `str.islower()`: at least one cased character, none uppercase.
pub fn is_lower(s: &str) -> bool {
    s.chars().any(is_cased) && !s.chars().any(char::is_uppercase)
}

/// `str.isupper()`: at least one cased character, none lowercase.
pub fn is_upper(s: &str) -> bool {
    s.chars().any(is_cased) && !s.chars().any(char::is_lowercase)
}

pub fn lower(s: &str) -> String {
    s.to_lowercase()
}

pub fn upper(s: &str) -> String {
    s.to_uppercase()
}

/// `str.capitalize()`: first character upper case, the rest lower case.
pub fn capitalize(s: &str) -> String {
    let mut cs = s.chars();
    match cs.next() {
        Some(first) => first
            .to_uppercase()
            .chain(cs.as_str().to_lowercase().chars())
            .collect(),
        None => String::new(),
    }
}

/// The string without its first character (`s[1:]`).
pub fn tail(s: &str) -> &str {
    let mut cs = s.chars();
    cs.next();
    cs.as_str()
}

/// The last `n` characters (`s[-n:]`).
pub fn last_chars(s: &str, n: usize) -> &str {
    let count = s.chars().count();
    if count <= n {
        return s;
    }
    let (idx, _) = s.char_indices().nth(count - n).unwrap_or((0, ' '));
    &s[idx..]
}

/// The first `n` characters (`s[:n]`).
pub fn first_chars(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((idx, _)) => &s[..idx],
        None => s,
    }
}

/// All but the last `n` characters (`s[:-n]`).
pub fn drop_last(s: &str, n: usize) -> &str {
    let count = s.chars().count();
    if count <= n {
        return "";
    }
    first_chars(s, count - n)
}

/// The `i`-th character from the end, 1-based (`s[-i]`).
pub fn nth_back(s: &str, i: usize) -> Option<char> {
    s.chars().rev().nth(i.checked_sub(1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicates_follow_python() {
        assert!(is_lower("abc'") && !is_lower("'") && !is_lower("aB"));
        assert!(is_upper("AB1") && !is_upper("12"));
        assert_eq!(capitalize("hELLO"), "Hello");
        assert_eq!(last_chars("héllo", 3), "llo");
        assert_eq!(drop_last("héllo", 3), "hé");
        assert_eq!(nth_back("abc", 2), Some('b'));
        assert!(is_digit("12") && !is_digit("1.2") && !is_digit(""));
    }
}
