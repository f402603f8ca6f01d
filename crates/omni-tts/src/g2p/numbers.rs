//! English number words (cardinal, ordinal, year, decimal) in the wording the lexicon layer reads:
//! "one thousand, two hundred and thirty-four", "twenty-third", "nineteen oh-five".

const ONES: [&str; 20] = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
];
const TENS: [&str; 10] = [
    "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
];
const SCALES: [&str; 12] = [
    "",
    "thousand",
    "million",
    "billion",
    "trillion",
    "quadrillion",
    "quintillion",
    "sextillion",
    "septillion",
    "octillion",
    "nonillion",
    "decillion",
];

fn below_1000(mut n: u128, words: &mut Vec<String>) {
    let start = words.len();
    if n >= 100 {
        words.push(ONES[(n / 100) as usize].to_string());
        words.push("hundred".to_string());
        n %= 100;
        if n != 0 {
            words.push("and".to_string());
        }
    }
    if n >= 20 {
        let mut w = TENS[(n / 10) as usize].to_string();
        if !n.is_multiple_of(10) {
            w.push('-');
            w.push_str(ONES[(n % 10) as usize]);
        }
        words.push(w);
    } else if n != 0 || words.len() == start {
        words.push(ONES[n as usize].to_string());
    }
}

/// Cardinal words; `None` past the decillions.
pub fn cardinal(n: u128) -> Option<String> {
    if n < 1000 {
        let mut w = Vec::new();
        below_1000(n, &mut w);
        return Some(w.join(" "));
    }
    let mut groups = Vec::new();
    let mut scale = 0;
    let mut n = n;
    while n != 0 {
        let g = n % 1000;
        n /= 1000;
        if g != 0 {
            let mut w = Vec::new();
            below_1000(g, &mut w);
            let mut text = w.join(" ");
            if scale > 0 {
                text.push(' ');
                text.push_str(SCALES.get(scale)?);
            }
            groups.push(text);
        }
        scale += 1;
    }
    groups.reverse();
    let last = groups.last()?.clone();
    let after_and = last.rsplit(" and ").next().unwrap_or(&last);
    if groups.len() > 1 && !after_and.contains(' ') && !last.contains("hundred") {
        let head = groups[..groups.len() - 1].join(", ");
        return Some(format!("{head} and {last}"));
    }
    Some(groups.join(", "))
}

fn ordinal_word(w: &str) -> String {
    match w {
        "one" => "first".into(),
        "two" => "second".into(),
        "three" => "third".into(),
        "five" => "fifth".into(),
        "eight" => "eighth".into(),
        "nine" => "ninth".into(),
        "twelve" => "twelfth".into(),
        _ => match w.strip_suffix('y') {
            Some(stem) => format!("{stem}ieth"),
            None => format!("{w}th"),
        },
    }
}

/// Ordinal words: "twenty-third", "one hundred and first".
pub fn ordinal(n: u128) -> Option<String> {
    let c = cardinal(n)?;
    let (head, last) = match c.rfind(' ') {
        Some(p) => (&c[..=p], &c[p + 1..]),
        None => ("", c.as_str()),
    };
    let last = match last.rfind('-') {
        Some(p) => format!("{}-{}", &last[..p], ordinal_word(&last[p + 1..])),
        None => ordinal_word(last),
    };
    Some(format!("{head}{last}"))
}

/// A year: "nineteen oh-five", "two thousand and five", "twenty ten".
pub fn year(n: u128) -> Option<String> {
    let (high, low) = (n / 100, n % 100);
    if high == 0 || (high % 10 == 0 && low < 10) || high >= 100 {
        return cardinal(n);
    }
    let low_text = if low == 0 {
        "hundred".to_string()
    } else if low < 10 {
        format!("oh-{}", cardinal(low)?)
    } else {
        cardinal(low)?
    };
    Some(format!("{} {low_text}", cardinal(high)?))
}

/// A decimal written with a point: "3.14" -> "three point one four" (trailing zeros dropped).
pub fn decimal(s: &str) -> Option<String> {
    let (ip, fp) = s.split_once('.').unwrap_or((s, ""));
    let fp = fp.trim_end_matches('0');
    let int: u128 = if ip.is_empty() { 0 } else { ip.parse().ok()? };
    let mut words = cardinal(int)?;
    if !fp.is_empty() {
        words.push_str(" point");
        for c in fp.chars() {
            words.push(' ');
            words.push_str(ONES[c.to_digit(10)? as usize]);
        }
    }
    Some(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_words() {
        assert_eq!(
            cardinal(1234).as_deref(),
            Some("one thousand, two hundred and thirty-four")
        );
        assert_eq!(cardinal(1001).as_deref(), Some("one thousand and one"));
        assert_eq!(cardinal(0).as_deref(), Some("zero"));
        assert_eq!(ordinal(23).as_deref(), Some("twenty-third"));
        assert_eq!(ordinal(101).as_deref(), Some("one hundred and first"));
        assert_eq!(ordinal(1000).as_deref(), Some("one thousandth"));
        assert_eq!(year(1905).as_deref(), Some("nineteen oh-five"));
        assert_eq!(year(2005).as_deref(), Some("two thousand and five"));
        assert_eq!(year(2010).as_deref(), Some("twenty ten"));
        assert_eq!(decimal("3.140").as_deref(), Some("three point one four"));
    }
}
