//! Exact money: an amount is integer minor units, parsed from a decimal string or an integer —
//! never from a float.

/// The largest amount accepted, in minor units (10^15: ten trillion in a 2-decimal currency).
pub const MAX_AMOUNT_MINOR: i64 = 1_000_000_000_000_000;

/// A settlement amount read from an `order.paid` payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Amount {
    /// Minor units (cents).
    pub minor: i64,
    /// ISO 4217 code.
    pub currency: String,
}

/// Formats minor units as a 2-decimal string (`1250` → `"12.50"`).
pub fn format_minor(minor: i64) -> String {
    let sign = if minor < 0 { "-" } else { "" };
    let abs = minor.unsigned_abs();
    format!("{sign}{}.{:02}", abs / 100, abs % 100)
}

/// Reads the amount of an `order.paid` payload: `"amount": "12.50"` (a decimal string with at
/// most two decimals) or `"amount_minor": 1250` (an integer), and `"currency"` (three capital
/// letters, default `EUR`). Returns a reason a person can act on.
pub fn parse_amount(payload: &serde_json::Value) -> Result<Amount, String> {
    let minor = match (payload.get("amount"), payload.get("amount_minor")) {
        (Some(_), Some(_)) => {
            return Err("the payload has both amount and amount_minor; send one".to_owned());
        }
        (None, None) => {
            return Err(
                "the payload has no amount (\"amount\": \"12.50\" or \"amount_minor\": 1250)"
                    .to_owned(),
            );
        }
        (Some(serde_json::Value::String(s)), None) => parse_decimal(s)?,
        (Some(serde_json::Value::Number(n)), None) => {
            return Err(format!(
                "amount {n} is a JSON number; send it as a decimal string (\"amount\": \"{n}\") or as integer minor units, never a float"
            ));
        }
        (Some(other), None) => return Err(format!("amount must be a decimal string, not {other}")),
        (None, Some(serde_json::Value::Number(n))) => match n.as_i64() {
            Some(v) => v,
            None => {
                return Err(format!(
                    "amount_minor {n} is not an integer number of minor units"
                ));
            }
        },
        (None, Some(other)) => return Err(format!("amount_minor must be an integer, not {other}")),
    };
    if minor <= 0 {
        return Err(format!(
            "amount must be positive, got {}",
            format_minor(minor)
        ));
    }
    if minor > MAX_AMOUNT_MINOR {
        return Err(format!(
            "amount {} exceeds the maximum of {}",
            format_minor(minor),
            format_minor(MAX_AMOUNT_MINOR)
        ));
    }
    let currency = match payload.get("currency") {
        None => "EUR".to_owned(),
        Some(serde_json::Value::String(c))
            if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) =>
        {
            c.clone()
        }
        Some(other) => {
            return Err(format!(
                "currency must be a 3-letter ISO code such as \"EUR\", got {other}"
            ));
        }
    };
    Ok(Amount { minor, currency })
}

fn parse_decimal(s: &str) -> Result<i64, String> {
    let bad = || format!("amount {s:?} is not a decimal such as \"12.50\"");
    let (neg, body) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (int, frac) = body.split_once('.').unwrap_or((body, ""));
    if int.is_empty()
        || !int.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    if body.contains('.') && frac.is_empty() {
        return Err(bad());
    }
    if frac.len() > 2 {
        return Err(format!("amount {s:?} has more than two decimals"));
    }
    let int: i64 = int.parse().map_err(|_| {
        format!(
            "amount {s:?} exceeds the maximum of {}",
            format_minor(MAX_AMOUNT_MINOR)
        )
    })?;
    let frac: i64 = format!("{frac:0<2}").parse().map_err(|_| bad())?;
    let minor = int
        .checked_mul(100)
        .and_then(|v| v.checked_add(frac))
        .ok_or_else(|| {
            format!(
                "amount {s:?} exceeds the maximum of {}",
                format_minor(MAX_AMOUNT_MINOR)
            )
        })?;
    Ok(if neg { -minor } else { minor })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn exact_amounts() {
        assert_eq!(
            parse_amount(&json!({"amount": "12.50"})).unwrap().minor,
            1250
        );
        assert_eq!(parse_amount(&json!({"amount": "7"})).unwrap().minor, 700);
        assert_eq!(parse_amount(&json!({"amount": "0.1"})).unwrap().minor, 10);
        assert_eq!(
            parse_amount(&json!({"amount_minor": 1250, "currency": "USD"})).unwrap(),
            Amount {
                minor: 1250,
                currency: "USD".into()
            }
        );
        assert_eq!(format_minor(1250), "12.50");
        assert_eq!(format_minor(-50), "-0.50");
        assert!(
            parse_amount(&json!({"amount": "-0.50"}))
                .unwrap_err()
                .contains("got -0.50")
        );
    }

    #[test]
    fn refused_amounts_say_why() {
        let cases = [
            (json!({"amount": "-5.00"}), "must be positive"),
            (json!({"amount": "0.00"}), "must be positive"),
            (json!({"amount_minor": 0}), "must be positive"),
            (
                json!({"amount": "99999999999999999999"}),
                "exceeds the maximum",
            ),
            (
                json!({"amount_minor": 9_000_000_000_000_000_i64}),
                "exceeds the maximum",
            ),
            (json!({"amount": "12.345"}), "more than two decimals"),
            (json!({"amount": "12,50"}), "not a decimal"),
            (json!({"amount": "abc"}), "not a decimal"),
            (json!({"amount": "1."}), "not a decimal"),
            (json!({"amount": 12.5}), "never a float"),
            (json!({"amount_minor": 12.5}), "not an integer"),
            (json!({}), "no amount"),
            (json!({"amount": "1.00", "currency": "euro"}), "3-letter"),
        ];
        for (payload, want) in cases {
            let err = parse_amount(&payload).unwrap_err();
            assert!(err.contains(want), "{payload}: {err}");
        }
    }
}
