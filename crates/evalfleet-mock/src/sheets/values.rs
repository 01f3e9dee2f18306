//! Cells: how they are stored, read back (formatted or not), written, and
//! how a URL's query and a form body are decoded.

use std::collections::BTreeSet;

use serde_json::{Number, Value};

use super::a1::Bounds;

/// How a read renders numbers and booleans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Render {
    /// As the grid shows them, in the default (automatic) format: `0.5` is
    /// `"0.5"`, `3` is `"3"`, `true` is `"TRUE"`.
    Formatted,
    /// As stored: numbers as numbers, booleans as booleans.
    Unformatted,
}

/// A value as a cell keeps it: `""` is an empty cell (`Null`).
pub(crate) fn stored(value: Value) -> Value {
    match value {
        Value::String(s) if s.is_empty() => Value::Null,
        other => other,
    }
}

/// How Sheets reads typed text (`USER_ENTERED`, and a CSV file imported):
/// a number is a number, `TRUE` and `FALSE` (any case) are booleans, and
/// anything else stays text (a formula is kept as its text: the stand-in
/// computes nothing). Empty text is an empty cell.
pub fn user_entered(text: &str) -> Value {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Value::Null;
    }
    if trimmed.eq_ignore_ascii_case("true") {
        return Value::Bool(true);
    }
    if trimmed.eq_ignore_ascii_case("false") {
        return Value::Bool(false);
    }
    let numeric = trimmed
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'));
    if numeric {
        if let Ok(n) = trimmed.parse::<i64>() {
            return Value::Number(n.into());
        }
        if let Some(n) = trimmed.parse::<f64>().ok().and_then(Number::from_f64) {
            return Value::Number(n);
        }
    }
    Value::String(text.to_owned())
}

/// A stored value as a read renders it.
pub(crate) fn render(value: &Value, how: Render) -> Value {
    match (value, how) {
        (Value::Null, _) => Value::String(String::new()),
        (Value::Number(n), Render::Formatted) => Value::String(format_number(n)),
        (Value::Bool(b), Render::Formatted) => {
            Value::String(if *b { "TRUE" } else { "FALSE" }.to_owned())
        }
        (other, _) => other.clone(),
    }
}

/// A number in Sheets' automatic format: integers in full, other numbers
/// in their shortest exact form, very large and very small ones in
/// scientific notation (`1E+21`).
fn format_number(n: &Number) -> String {
    if let Some(i) = n.as_i64() {
        return i.to_string();
    }
    if let Some(u) = n.as_u64() {
        return u.to_string();
    }
    let f = n.as_f64().unwrap_or(0.0);
    let magnitude = f.abs();
    if magnitude != 0.0 && !(1e-9..1e15).contains(&magnitude) {
        let text = format!("{f:E}");
        return match text.split_once('E') {
            Some((mantissa, exp)) if !exp.starts_with('-') => format!("{mantissa}E+{exp}"),
            _ => text,
        };
    }
    if f.fract() == 0.0 {
        format!("{f:.0}")
    } else {
        f.to_string()
    }
}

/// The cells of `bounds`, rendered by `show`, with the trailing empty
/// cells of each row and the trailing empty rows left out.
pub(crate) fn read(
    cells: &[Vec<Value>],
    b: Bounds,
    show: impl Fn(&Value) -> Value,
) -> Vec<Vec<Value>> {
    let first_row = b.first_row as usize - 1;
    let last_row = (b.last_row as usize).min(cells.len());
    let first_col = b.first_col as usize - 1;
    let mut rows: Vec<Vec<Value>> = cells
        .get(first_row..last_row.max(first_row))
        .unwrap_or_default()
        .iter()
        .map(|row| {
            let last_col = (b.last_col as usize).min(row.len());
            let slice = row
                .get(first_col..last_col.max(first_col))
                .unwrap_or_default();
            let used = slice
                .iter()
                .rposition(|v| !v.is_null())
                .map_or(0, |i| i + 1);
            slice[..used].iter().map(&show).collect()
        })
        .collect();
    while rows.last().is_some_and(Vec::is_empty) {
        rows.pop();
    }
    rows
}

/// Rows become columns, a short row padded with `pad` (`""` in a read,
/// `null` in a write, where it leaves the cell alone); each column's
/// trailing empties are trimmed.
pub(crate) fn transpose(rows: &[Vec<Value>], pad: &Value) -> Vec<Vec<Value>> {
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut columns: Vec<Vec<Value>> = (0..width)
        .map(|c| {
            rows.iter()
                .map(|row| row.get(c).unwrap_or(pad).clone())
                .collect()
        })
        .collect();
    for column in &mut columns {
        while column
            .last()
            .is_some_and(|v| v.is_null() || v.as_str() == Some(""))
        {
            column.pop();
        }
    }
    columns
}

/// What one range's write changed: the cells written (row and column from
/// 1), and how many rows and columns hold one of them.
pub(crate) struct Written {
    pub cells: Vec<(u32, u32)>,
    pub rows: u64,
    pub cols: u64,
}

/// Writes `rows` into `cells` from `origin` (row, column from 1): a `null`
/// leaves its cell alone, `""` clears it, anything else is stored as given.
/// The caller has checked that the values fit in the grid.
pub(crate) fn write(
    cells: &mut Vec<Vec<Value>>,
    origin: (u32, u32),
    rows: &[Vec<Value>],
) -> Written {
    let (r0, c0) = (origin.0 as usize - 1, origin.1 as usize - 1);
    let mut written = Vec::new();
    let mut touched_cols = BTreeSet::new();
    let mut touched_rows = 0;
    for (r, row) in rows.iter().enumerate() {
        let mut any = false;
        for (c, value) in row.iter().enumerate() {
            if value.is_null() {
                continue;
            }
            let (at_row, at_col) = (r0 + r, c0 + c);
            if cells.len() <= at_row {
                cells.resize(at_row + 1, Vec::new());
            }
            let line = &mut cells[at_row];
            if line.len() <= at_col {
                line.resize(at_col + 1, Value::Null);
            }
            line[at_col] = stored(value.clone());
            written.push((at_row as u32 + 1, at_col as u32 + 1));
            touched_cols.insert(at_col);
            any = true;
        }
        touched_rows += u64::from(any);
    }
    Written {
        cells: written,
        rows: touched_rows,
        cols: touched_cols.len() as u64,
    }
}

/// A write call's ranges, rows and non-null cells, read leniently from a
/// body that may not be valid (for its record).
pub(crate) fn summary(body: &[u8]) -> (Vec<String>, usize, usize) {
    let Ok(body) = serde_json::from_slice::<Value>(body) else {
        return (Vec::new(), 0, 0);
    };
    let data = body.get("data").and_then(Value::as_array);
    let mut ranges = Vec::new();
    let (mut rows, mut cells) = (0, 0);
    for item in data.into_iter().flatten() {
        if let Some(range) = item.get("range").and_then(Value::as_str) {
            ranges.push(range.to_owned());
        }
        for row in item
            .get("values")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            rows += 1;
            cells += row
                .as_array()
                .map_or(0, |r| r.iter().filter(|v| !v.is_null()).count());
        }
    }
    (ranges, rows, cells)
}

/// `a=1&b=x+y` as pairs, percent-decoded (`+` is a space); pairs that do
/// not decode are left out.
pub(crate) fn form(text: &str) -> Vec<(String, String)> {
    text.split('&')
        .filter(|pair| !pair.is_empty())
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = |s: &str| percent_decode(&s.replace('+', " "));
            Some((decode(key)?, decode(value)?))
        })
        .collect()
}

/// `%XX` escapes decoded; `None` when an escape is malformed or the result
/// is not UTF-8.
pub(crate) fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_are_formatted_as_the_grid_shows_them() {
        for (value, shown) in [
            (json!(0.5), "0.5"),
            (json!(3), "3"),
            (json!(3.0), "3"),
            (json!(-12.25), "-12.25"),
            (json!(1e21), "1E+21"),
            (json!(true), "TRUE"),
            (json!(false), "FALSE"),
        ] {
            assert_eq!(render(&value, Render::Formatted), json!(shown), "{value}");
        }
        assert_eq!(render(&json!(0.5), Render::Unformatted), json!(0.5));
    }

    #[test]
    fn typed_text_becomes_numbers_and_booleans() {
        assert_eq!(user_entered("42"), json!(42));
        assert_eq!(user_entered("0.25"), json!(0.25));
        assert_eq!(user_entered("true"), json!(true));
        assert_eq!(user_entered("=1+1"), json!("=1+1"));
        assert_eq!(user_entered("1-2"), json!("1-2"));
        assert_eq!(user_entered(""), Value::Null);
    }

    #[test]
    fn escapes_are_decoded_and_bad_ones_refused() {
        assert_eq!(
            percent_decode("Sheet1%21A1%3AF").as_deref(),
            Some("Sheet1!A1:F")
        );
        assert_eq!(
            percent_decode("%27My%20Tab%27").as_deref(),
            Some("'My Tab'")
        );
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%+1"), None);
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(
            form("grant_type=a%3Ab&assertion=x+y&flag"),
            vec![
                ("grant_type".to_owned(), "a:b".to_owned()),
                ("assertion".to_owned(), "x y".to_owned()),
                ("flag".to_owned(), String::new()),
            ]
        );
    }
}
